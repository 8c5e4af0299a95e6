"""Latency on an NVIDIA GPU: original / plain / fused / compensated / fused compensated graphs of a synthetic
Llama-shaped model (Llama-3.2-1B's shape, or Llama-3-8B's) in float16, and of SmolLM2-135M where its export is at
hand; prefill (batch x 512) and decode (1 token after a cache of 512) at batch 1, 8 and 32, IO binding, repeats
interleaved across the graphs of one block set; one table of ratios with their spread.

    python benchmarks/cuda.py [--models synthetic,smollm2] [--shape 1b|8b] [--dtype float16] [--batches 1,8,32]
                              [--seq-len 512] [--repeats 20] [--warmup 5] [--synthetic-layers "half;all"]
                              [--smollm2-layers 4,6-8,15,22-23,25,28-29] [--fit-windows 32]
    python benchmarks/cuda.py --smoke     # CPU, tiny models, a few repeats: checks the script, measures nothing
    bash benchmarks/gpu.sh                # on the GPU machine: installs the carried onnxruntime-gpu wheel, runs this

Without a working CUDAExecutionProvider it says so in one line and exits 1. Every session must run on
CUDA; its `placement` column says `CUDA` when ORT ran every node there, or lists the ops (and counts)
that ORT placed on the CPU, read from the profile of each session's first warm-up. Inputs are placed
on the device once, outputs stay there, and the decode's past is the prefill's present, left on the
device (runtime.Prepared, runtime.decode_inputs), so no timed run copies to or from the host. SmolLM2's blocks are the ones `surgery parallelize` chose on it
before issue 18 (--smollm2-layers to change them), compensated with a fix fitted on --fit-windows calibration windows of the built-in corpus.
The synthetic model (random weights, written once to out/llama-<shape>-random-<dtype> with external data) is
rewritten at each --synthetic-layers set (`half`: its later half of blocks, `all`, or a layer list); its
compensated graphs fold a random fix of the fitted form (w_a, w_p, b): the same ops and shapes as a fitted one, as a
fit on random weights would mean nothing. It needs numpy, onnx_ir and onnxruntime alone (no tokenizers, torch or
ray), as on a machine that reaches no registry. (It is built
here, not by graphs/big_decoder.py, because decode needs a KV cache, which that graph does not have.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from common import ROOT, smollm2, table

from surgery import graph, runtime, timing
from surgery.blocks import find_blocks
from surgery.job import rewrite
from surgery.layers import format_layers, parse_layers
from surgery.passes import Fix

# Llama-3.2-1B's and Llama-3-8B's shapes with a 32k vocabulary: 1.1 B and 7.0 B parameters (2.2 and 14 GB in float16)
SHAPES = {
    "1b": {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_mlp": 8192, "vocab": 32000, "max_positions": 2048},
    "8b": {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "d_mlp": 14336, "vocab": 32000, "max_positions": 2048},
}
TINY = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128, vocab=512, max_positions=256)
SMOLLM2_LAYERS = "4,6-8,15,22-23,25,28-29"
WAYS = ("ORT", "ORT + CUDA graphs")  # as ORT runs each node, and captured once as a CUDA graph and replayed  # what `surgery parallelize out/smollm2` chose before issue 18's KL budget


def llama_shaped(d_model, n_layers, n_heads, n_kv_heads, d_mlp, vocab, max_positions, dtype="float32", seed=0) -> ir.Model:
    """A Llama-shaped decoder with random weights and a KV cache, in the form `surgery export` gives:
    inputs input_ids, attention_mask, position_ids, past_key_values.N.key/value; outputs logits,
    present.N.key/value. Decomposed RMSNorm, rotary positions, grouped-query attention, SiLU-gated mlp."""
    rng = np.random.default_rng(seed)
    d_head, rep = d_model // n_heads, n_heads // n_kv_heads
    nodes, inits, inputs, outputs = [], [], [], []
    ft = np.dtype(dtype)  # the weights', activations' and KV cache's type
    fx, i64 = ir.DataType.from_numpy(ft), ir.DataType.INT64

    made: dict[str, ir.Value] = {}

    def const(name, array):
        if name not in made:
            tensor = ir.tensor(array, name=name)
            made[name] = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor)
            inits.append(made[name])
        return made[name]

    def weight(name, *shape, std=0.02):
        return const(name, (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(ft))

    def op(op_type, *args, name=None, **attrs):
        node = ir.node(op_type, list(args), attributes=attrs, name=name or f"n{len(nodes)}/{op_type}")
        node.outputs[0].name = node.name
        nodes.append(node)
        return node.outputs[0]

    def graph_input(name, dtype, dims):
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))
        inputs.append(value)
        return value

    def graph_output(value, name, dtype, dims):
        value.name, value.type, value.shape = name, ir.TensorType(dtype), ir.Shape(dims)
        outputs.append(value)

    two, eps = const("two", np.array(2.0, ft)), const("eps", np.array(1e-5, ft))
    last = const("last_axis", np.array([-1], np.int64))

    def rms(x, layer, which):
        mean = op("ReduceMean", op("Pow", x, two), last, keepdims=1)
        return op("Mul", op("Mul", x, op("Reciprocal", op("Sqrt", op("Add", mean, eps)))), const(f"{which}.{layer}", np.ones(d_model, ft)))

    ids = graph_input("input_ids", i64, ["batch", "sequence_length"])
    mask = graph_input("attention_mask", i64, ["batch", "total_length"])
    positions = graph_input("position_ids", i64, ["batch", "sequence_length"])
    # rotary tables [max_positions, d_head] read at position_ids: [batch, 1, seq, d_head]
    angles = np.outer(np.arange(max_positions), 10000.0 ** (-np.arange(0, d_head, 2) / d_head))
    angles = np.concatenate([angles, angles], axis=1)
    one_axis = const("axis_1", np.array([1], np.int64))
    cos = op("Unsqueeze", op("Gather", const("rope.cos", np.cos(angles).astype(ft)), positions), one_axis)
    sin = op("Unsqueeze", op("Gather", const("rope.sin", np.sin(angles).astype(ft)), positions), one_axis)
    # additive mask [batch, 1, seq, total]: key j is seen by query i when pos(j) <= pos(i) and mask[j] = 1
    key_pos = op("Sub", op("CumSum", mask, const("axis_1s", np.array(1, np.int64))), const("one", np.array(1, np.int64)))
    axis_2 = const("axis_2", np.array([2], np.int64))
    causal = op("LessOrEqual", op("Unsqueeze", key_pos, one_axis), op("Unsqueeze", positions, axis_2))
    seen = op("And", causal, op("Cast", op("Unsqueeze", mask, one_axis), to=ir.DataType.BOOL))
    bias = op("Unsqueeze", op("Where", seen, const("zero", np.array(0.0, ft)), const("neg", np.array(-1e4 if ft == np.float16 else -1e9, ft))), one_axis)
    half = const("halves", np.array([d_head // 2, d_head // 2], np.int64))
    scale = const("scale", np.array(d_head**-0.5, ft))

    def heads(x, n):  # [batch, seq, n * d_head] -> [batch, n, seq, d_head]
        return op("Transpose", op("Reshape", x, const(f"heads_shape.{n}", np.array([0, 0, n, d_head], np.int64))), perm=[0, 2, 1, 3])

    def rotate(x):  # x * cos + rotate_half(x) * sin, x [batch, heads, seq, d_head]
        split = ir.node("Split", [x, half], attributes={"axis": -1}, num_outputs=2, name=f"n{len(nodes)}/Split")
        nodes.append(split)
        x1, x2 = split.outputs
        x1.name, x2.name = f"{split.name}/0", f"{split.name}/1"
        return op("Add", op("Mul", x, cos), op("Mul", op("Concat", op("Neg", x2), x1, axis=-1), sin))

    x = op("Gather", weight("embed_tokens", vocab, d_model), ids, name="embed")
    for l in range(n_layers):
        a = rms(x, l, "ln1")
        q = rotate(heads(op("MatMul", a, weight(f"q.{l}", d_model, d_model)), n_heads))
        k = rotate(heads(op("MatMul", a, weight(f"k.{l}", d_model, n_kv_heads * d_head)), n_kv_heads))
        v = heads(op("MatMul", a, weight(f"v.{l}", d_model, n_kv_heads * d_head)), n_kv_heads)
        kv_dims = ["batch", n_kv_heads, "past_sequence_length", d_head]
        k = op("Concat", graph_input(f"past_key_values.{l}.key", fx, kv_dims), k, axis=2)
        v = op("Concat", graph_input(f"past_key_values.{l}.value", fx, kv_dims), v, axis=2)
        graph_output(k, f"present.{l}.key", fx, ["batch", n_kv_heads, "total_length", d_head])
        graph_output(v, f"present.{l}.value", fx, ["batch", n_kv_heads, "total_length", d_head])
        if rep > 1:  # grouped-query attention: each kv head serves `rep` query heads
            repeat, merged = const("repeat", np.array([1, 1, rep, 1, 1], np.int64)), const("merged", np.array([0, n_heads, -1, d_head], np.int64))
            k, v = (op("Reshape", op("Expand", op("Unsqueeze", t, axis_2), repeat), merged) for t in (k, v))
        scores = op("Add", op("Mul", op("MatMul", q, op("Transpose", k, perm=[0, 1, 3, 2])), scale), bias)
        mixed = op("MatMul", op("Softmax", scores, axis=-1), v)
        merged_heads = op("Reshape", op("Transpose", mixed, perm=[0, 2, 1, 3]), const("model_shape", np.array([0, 0, d_model], np.int64)))
        h = op("Add", x, op("MatMul", merged_heads, weight(f"o.{l}", d_model, d_model), name=f"blocks.{l}.attn_out"), name=f"blocks.{l}.resid_mid")
        m = rms(h, l, "ln2")
        gate = op("MatMul", m, weight(f"gate.{l}", d_model, d_mlp))
        up = op("MatMul", m, weight(f"up.{l}", d_model, d_mlp))
        act = op("Mul", op("Mul", gate, op("Sigmoid", gate)), up)
        x = op("Add", h, op("MatMul", act, weight(f"down.{l}", d_mlp, d_model), name=f"blocks.{l}.mlp_out"), name=f"blocks.{l}.resid_post")
    logits = op("MatMul", rms(x, 0, "ln_f"), weight("lm_head", d_model, vocab))
    graph_output(logits, "logits", fx, ["batch", "sequence_length", vocab])
    outputs.insert(0, outputs.pop())
    g = ir.Graph(inputs, outputs, nodes=nodes, initializers=inits, opset_imports={"": 18}, name="llama_shaped")
    return ir.Model(g, ir_version=9, producer_name="benchmarks/cuda.py")


def synthetic(folder: Path, shape: dict) -> Path:
    """The Llama-shaped model of `shape`, written once to `folder` (external data past 1 GB); rebuilt when the shape changes."""
    config = folder / "config.json"
    if not (config.is_file() and json.loads(config.read_text()) == shape and (folder / graph.MODEL_FILE).is_file()):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        graph.save(llama_shaped(**shape), folder / graph.MODEL_FILE)
        config.write_text(json.dumps(shape))
    return folder


def random_fixes(d_model: int, layers, seed: int = 0) -> dict[int, Fix]:
    """Small random fixes of the fitted form (full w_a, w_p and b) for a model whose fit would mean nothing."""
    rng = np.random.default_rng(seed)
    small = lambda *shape: rng.normal(0, 1e-3, shape)  # noqa: E731
    return {l: Fix(w_a=small(d_model, d_model), w_p=small(d_model, d_model), b=small(d_model)) for l in layers}


def variants(model: ir.Model, layers, fixes) -> dict[str, ir.Model]:
    return {
        "original": model,
        "plain": rewrite(model, layers).model,
        "fused": rewrite(model, layers, fused=True).model,
        "compensated": rewrite(model, layers, fixes=fixes).model,
        "fused compensated": rewrite(model, layers, fused=True, fixes=fixes).model,
    }


def block_sets(spec: str, n_blocks: int) -> list[list[int]]:
    """--synthetic-layers: `;`-separated sets, each `half` (the later half of the blocks), `all` or a layer list."""
    later_half = ",".join(map(str, range(n_blocks // 2, n_blocks)))
    return [parse_layers(later_half if item.strip() == "half" else item.strip(), n_blocks) for item in spec.split(";")]


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "GPU name unknown (no nvidia-smi)"
    except (OSError, subprocess.TimeoutExpired):
        return "GPU name unknown (no nvidia-smi)"


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
                from surgery.job import fit_fixes  # reads the corpus: tokenizers

                fixes = fit_fixes(model, folder, sets[0], seq_len=fit_len, fit_windows=args.fit_windows, options=options)
                label = f"{'tiny-llama (smoke)' if args.smoke else 'SmolLM2-135M'} (its export's type)"
            elif name == "synthetic":
                shape = {**(TINY if args.smoke else SHAPES[args.shape]), "dtype": args.dtype}
                where = Path(tmp) / "tiny" if args.smoke else ROOT / "out" / f"llama-{args.shape}-random-{args.dtype}"
                model = graph.load(synthetic(where, shape))
                sets = block_sets(args.synthetic_layers, len(find_blocks(model)))
                fixes = random_fixes(shape["d_model"], range(shape["n_layers"]))
                label = f"Llama-shaped d{shape['d_model']} x{shape['n_layers']} {args.dtype} (random)"
            else:
                parser.error(f"unknown model {name!r}; use synthetic or smollm2")
            log(f"{label}: loaded in {time.perf_counter() - start:.0f} s")
            for layers in sets:
                more, first = _measure(model, label, layers, {l: fixes[l] for l in layers}, batches, args, options, Path(tmp) / name, log)
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
    start = time.perf_counter()
    graphs = variants(model, layers, fixes)
    tmp.mkdir(exist_ok=True)
    blocks = format_layers(layers)
    rows, first = [], []
    for way in WAYS[: 2 if args.cuda_graphs else 1]:
        captured = way != "ORT"
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
        timed = {}
        for batch in batches:
            start = time.perf_counter()
            timed[batch] = timing.latency(list(sessions.values()), batch=batch, seq_len=args.seq_len, repeats=args.repeats,
                                          warmup=args.warmup, bind=True, graphs=captured)
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
