"""Latency on an NVIDIA GPU: original / plain / fused / compensated / fused compensated graphs of a synthetic
Llama-shaped model (benchmarks/common.py: Llama-3.2-1B's shape, or Llama-3-8B's) in float16, and of SmolLM2-135M
where its export is at hand; prefill (batch x 512) and decode (1 token after a cache of 512) at batch 1, 8 and 32, IO
binding, repeats interleaved across the graphs of one block set, as ORT runs each node and captured as CUDA graphs and
replayed; one table of ratios with their spread.

    python benchmarks/cuda.py [--models synthetic,smollm2] [--shape 1b|8b] [--dtype float16] [--batches 1,8,32]
                              [--seq-len 512] [--repeats 20] [--warmup 5] [--synthetic-layers "half;all"]
                              [--no-cuda-graphs] [--smollm2-layers 4,6-8,15,22-23,25,28-29] [--fit-windows 32]
    python benchmarks/cuda.py --smoke     # CPU, tiny models, a few repeats: checks the script, measures nothing
    bash benchmarks/gpu.sh                # on the GPU machine: installs the carried wheels, runs the whole suite

Without a working CUDAExecutionProvider it says so in one line and exits 1. Every session must run on
CUDA; its `placement` column says `CUDA` when ORT ran every node there, or lists the ops (and counts)
that ORT placed on the CPU, read from the profile of each session's first warm-up. Inputs are placed
on the device once, outputs stay there, and the decode's past is the prefill's present, left on the
device (runtime.Prepared, runtime.decode_inputs), so no timed run copies to or from the host.
The `ORT + CUDA graphs` rows are the same graphs in sessions made with ORT's enable_cuda_graph
(runtime.Options.cuda_graph): prefill and decode each captured once (graph ids 1 and 2) on buffers allocated once,
then replayed, which takes the host's per-kernel launch cost away. ORT refuses such a session when a node would
run off CUDA: the row then says `refused:` and ORT's reason.
SmolLM2's blocks are the ones `surgery parallelize` chose on it before issue 18 (--smollm2-layers to change them),
compensated with a fix fitted on --fit-windows calibration windows of the built-in corpus. The synthetic model
(random weights, written once to out/llama-<shape>-random-<dtype> with external data) is rewritten at each
--synthetic-layers set (`half`: its later half of blocks, `all`, or a layer list); its compensated graphs fold a
random fix of the fitted form (w_a, w_p, b): the same ops and shapes as a fitted one, as a fit on random weights
would mean nothing. It needs numpy, onnx_ir and onnxruntime alone (no tokenizers, torch or ray), as on a machine
that reaches no registry.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import onnx_ir as ir
import onnxruntime as ort
from common import ROOT, SHAPES, TINY, block_sets, gpu_name, random_fixes, smollm2, table, written

from surgery.engine import runtime
from surgery.files import graph
from surgery.jobs.job import parallel_form
from surgery.measure import timing
from surgery.model.blocks import find_blocks
from surgery.model.layers import format_layers, parse_layers

SMOLLM2_LAYERS = "4,6-8,15,22-23,25,28-29"  # what `surgery parallelize out/smollm2` chose before issue 18's KL budget
WAYS = ("ORT", "ORT + CUDA graphs")  # as ORT runs each node, and captured once as a CUDA graph and replayed


def variants(model: ir.Model, layers, fixes) -> dict[str, ir.Model]:
    return {
        "original": model,
        "plain": parallel_form(model, layers).model,
        "fused": parallel_form(model, layers, fused=True).model,
        "compensated": parallel_form(model, layers, fixes=fixes).model,
        "fused compensated": parallel_form(model, layers, fused=True, fixes=fixes).model,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="synthetic", help="comma-separated: synthetic, smollm2 (needs out/smollm2 or the hub)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="the synthetic model's shape")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16", help="the synthetic model's type")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--seq-len", type=int, default=512, help="prefill length, and the decode's cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smollm2-layers", default=SMOLLM2_LAYERS)
    parser.add_argument("--synthetic-layers", default="half;all", help="`;`-separated block sets: half (the later half), all, or a layer list")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="also time each graph captured as a CUDA graph and replayed (ORT's enable_cuda_graph; on the CPU, in --smoke, "
                        "the same fixed-buffer runs without a graph)")
    parser.add_argument("--fit-windows", type=int, default=32, help="calibration windows of 256 tokens for SmolLM2's fix")
    parser.add_argument("--smoke", action="store_true", help="CPU, graphs/tiny-llama for SmolLM2, a tiny synthetic model, "
                        "seq-len 32, 3 repeats, IO binding on host buffers: checks the script end to end, measures nothing")
    args = parser.parse_args()

    if not args.smoke and not runtime.cuda_usable():
        listed = ort.get_available_providers()
        why = ("it is listed but a CUDA session cannot start (no GPU or driver)" if runtime.CUDA in listed
               else f"this onnxruntime build has none (providers: {', '.join(listed)})")
        print(f"benchmarks/cuda.py needs an NVIDIA GPU with a working CUDAExecutionProvider; onnxruntime {ort.__version__}: {why}; "
              "`--smoke` checks the script on CPU", file=sys.stderr)
        sys.exit(1)
    if args.smoke:
        args.seq_len, args.repeats, args.warmup, args.fit_windows = 32, 3, 1, 4
    device, fit_len = ("cpu", 32) if args.smoke else ("cuda", 256)
    options = runtime.Options(device=device)
    batches = [int(b) for b in args.batches.split(",")]
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    header = (f"onnxruntime {ort.__version__}, {'CPU smoke test, not a measurement' if args.smoke else gpu_name()}, "
              f"{args.repeats} interleaved repeats (warm-up {args.warmup}), IO binding, "
              f"prefill batch x {args.seq_len}, decode 1 token after a cache of {args.seq_len}")
    rows, timed = [], []  # the table, and each graph's first-batch Latency (its provider and placement)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            start = time.perf_counter()
            if name == "smollm2":
                folder = ROOT / "graphs" / "tiny-llama" if args.smoke else smollm2()
                model = graph.load(folder)
                sets = [parse_layers(args.smollm2_layers if not args.smoke else "all", len(find_blocks(model)))]
                from surgery.compensation.fitting import FitSettings
                from surgery.jobs.job import fit_fixes  # reads the corpus: tokenizers
                from surgery.model.subject import Subject
                from surgery.text.data import DataSettings

                fixes = fit_fixes(Subject(model, str(folder)), sets[0], FitSettings(windows=args.fit_windows), DataSettings(seq_len=fit_len), options)
                label = f"{'tiny-llama (smoke)' if args.smoke else 'SmolLM2-135M'} (its export's type)"
            elif name == "synthetic":
                shape = {**(TINY if args.smoke else SHAPES[args.shape]), "dtype": args.dtype}
                where = Path(tmp) / "tiny" if args.smoke else ROOT / "out" / f"llama-{args.shape}-random-{args.dtype}"
                model = graph.load(written(where, shape))
                sets = block_sets(args.synthetic_layers, len(find_blocks(model)))
                fixes = random_fixes(shape["d_model"], range(shape["n_layers"]))
                label = f"Llama-shaped d{shape['d_model']} x{shape['n_layers']} {args.dtype} (random)"
            else:
                parser.error(f"unknown model {name!r}; use synthetic or smollm2")
            log(f"{label}: loaded in {time.perf_counter() - start:.0f} s")
            for layers in sets:
                more, first = _measure(model, label, layers, {l: fixes[l] for l in layers}, batches, args, options, Path(tmp) / name, log)
                log(table(more, list(more[0])))  # in the log as each block set ends: a run stopped later keeps these
                rows, timed = rows + more, timed + first
            del model
    expected = runtime.CPU if args.smoke else runtime.CUDA
    providers = {t.provider for t in timed}
    if providers != {expected}:
        print(f"error: sessions ran on {', '.join(sorted(providers))}, not {expected} alone", file=sys.stderr)
        sys.exit(1)
    complete = all(t.placement is not None and not t.placement.on_cpu for t in timed)
    print(f"{header}; " + (f"every node of every session on {expected}" if complete else
                           f"every session on {expected}, with the ops ORT placed on the CPU in the placement column"))
    print(table(rows, list(rows[0])))
    print("\nms = median [p90]; x = original median / this graph's median (> 1 is faster), from one interleaved run per model, "
          "block set and batch")


def _measure(model, label, layers, fixes, batches, args, options, tmp: Path, log) -> tuple[list[dict], list[timing.Latency]]:
    """One block set: its graphs' sessions, timed interleaved at each batch, first as ORT runs them, then (--cuda-graphs)
    captured as CUDA graphs and replayed; one row per graph and way, and each graph's ORT Latency at the first batch."""
    graphs = variants(model, layers, fixes)
    tmp.mkdir(exist_ok=True)
    blocks = format_layers(layers)
    rows, first = [], []
    for way in WAYS[: 2 if args.cuda_graphs else 1]:
        start, captured = time.perf_counter(), way != "ORT"
        if captured:  # the same graphs, each session asking ORT to capture its runs (it refuses one with a node off CUDA)
            sessions, refused = {}, {}
            for g, m in graphs.items():
                try:
                    sessions[g] = runtime.session(m, dataclasses.replace(options, cuda_graph=True))
                except Exception as e:  # noqa: BLE001 - ORT's refusal is the finding: reported in the table
                    refused[g] = str(e).strip().splitlines()[0][:160]
            if "original" in refused:
                log(f"{label}, blocks {blocks}: {way}: the original was refused ({refused['original']}); no replayed times")
                rows.append({"model": label, "graph": "original", "runtime": way, "placement": f"refused: {refused['original']}"})
                continue
        else:  # profiled until the first latency run's warm-up ends: where ORT placed each node
            sessions, refused = {g: runtime.session(m, dataclasses.replace(options, profile=str(tmp / f"{len(layers)}-{g.replace(' ', '-')}")))
                                 for g, m in graphs.items()}, {}
        log(f"{label}, blocks {blocks}: {way}: {len(sessions)} sessions in {time.perf_counter() - start:.0f} s")
        timed: dict[int, list[timing.Latency] | str] = {}  # by batch: the sessions' Latency, or why the captured runs failed
        for batch in batches:
            start = time.perf_counter()
            try:
                timed[batch] = timing.latency(list(sessions.values()), batch=batch, seq_len=args.seq_len, repeats=args.repeats,
                                              warmup=args.warmup, bind=True, graphs=captured)
            except Exception as e:  # noqa: BLE001 - a capture ORT cannot replay is a finding; as ORT runs them, any error stops the run
                if not captured:
                    raise
                timed[batch] = f"failed: {str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__}"
            log(f"{label}, blocks {blocks}: {way}: batch {batch} timed in {time.perf_counter() - start:.0f} s")
        names = list(sessions)
        for g in graphs:
            row = {"model": label, "graph": g, "runtime": way, "blocks": "-" if g == "original" else f"{len(layers)}: {blocks}"}
            if g in refused:
                rows.append({**row, "placement": f"refused: {refused[g]}"})
                continue
            i = names.index(g)
            row["placement"] = ("CUDA graph" if options.device == "cuda" else "CPU, fixed buffers") if captured else str(timed[batches[0]][i].placement)
            for batch in batches:
                if isinstance(timed[batch], str):
                    row[f"prefill b{batch} ms (x)"] = row[f"decode b{batch} ms (x)"] = timed[batch]
                    continue
                base, r = timed[batch][0], timed[batch][i]
                row[f"prefill b{batch} ms (x)"] = f"{r.prefill_ms:.2f} [{r.prefill_p90_ms:.2f}] ({base.prefill_ms / r.prefill_ms:.3f})"
                row[f"decode b{batch} ms (x)"] = f"{r.decode_ms:.3f} [{r.decode_p90_ms:.3f}] ({base.decode_ms / r.decode_ms:.3f})"
            rows.append(row)
        if not captured:
            first = timed[batches[0]]
        del sessions, timed  # one way's sessions at a time on the device
    return rows, first


if __name__ == "__main__":
    main()
