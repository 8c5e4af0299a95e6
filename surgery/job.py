"""The main job of `surgery parallelize`: auto (load, fit, select, rewrite, evaluate, time, write) and its Outcome,
and what explicit --layers runs: fit_fixes and rewrite."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import onnx_ir as ir

from surgery import cluster, compensation, data, evaluate, graph, memory, runtime, timing
from surgery.blocks import BlockMap
from surgery.checkpoint import Checkpoints, digest, model_digest
from surgery.errors import SurgeryError
from surgery.evaluate import Delta
from surgery.passes import Fix, compensate, fuse, parallelize
from surgery.passes.fuse import refusal as fuse_refusal
from surgery.progress import Tell, counter, silent
from surgery.report import selection_picture
from surgery.select import Fit, Selection, select_layers
from surgery.subject import Subject


def fit_fixes(model: ir.Model, model_path, layers, *, fit: Fit = "full", corpus=None, seq_len=256, fit_windows=64,
              tokenizer=None, options=runtime.Options(), fit_memory: int | str | None = None, requantize: str = "gptq",
              input_side: bool = True) -> dict[int, Fix]:
    """The fixes of the given sequential blocks, fitted in one pass over calibration windows (explicit --layers).
    A block whose fit fails is an error: compensation was asked for, so it is never silently written plain."""
    windows = data.windows(model_path, corpus, seq_len=seq_len, max_windows=fit_windows, part="calibration", tokenizer=tokenizer)
    fits = compensation.fit(model, windows, set(layers), kind=fit, options=options, memory_bytes=memory.memory_bound(fit_memory),
                            requantize=requantize, input_side=input_side)
    for layer, f in sorted(fits.items()):
        if f.fix is None:
            raise SurgeryError(f"cannot compensate block {layer}: {f.note}; or parallelize it plain with --no-compensate")
    return {l: f.fix for l, f in fits.items()}


def rewrite(model: "ir.Model | Subject", layers, *, fused: bool = False, fixes: dict[int, Fix] | None = None):
    """Make `layers` parallel, plain (ln2 reads resid_pre) or fused; the layers in `fixes` get their
    fix folded into the output projections (compensated, or calibrated with Fix.gate). Returns a SurgeryResult."""
    fixes = {l: f for l, f in (fixes or {}).items() if l in set(layers)}
    if fused:
        return fuse(model, layers, fixes)
    first = compensate(model, fixes) if fixes else None
    rest = parallelize(first.subject if first else model, [l for l in layers if l not in fixes])  # the blocks as compensate left them
    changes = {c.layer: c for c in (first.changes if first else ()) + rest.changes}
    return dataclasses.replace(rest, changes=tuple(changes[l] for l in sorted(changes)))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `surgery parallelize --layers auto` reports and writes to selection.json."""

    selection: Selection
    form: str  # "plain", "compensated", "calibrated", each maybe "fused ..."
    base_loss_eval: float
    dnll_eval: Delta  # held-out evaluation windows, 95 % paired bootstrap interval
    eval_tokens: int
    divergence_eval: evaluate.Divergence  # KL vs the original, p99, top-1 agreement, llama.cpp's statistics on the evaluation windows
    estimated_speedup: float  # the paper's max(t_attn, t_mlp) estimate, from per-branch kernel times
    prefill_ratio: float | None  # original / rewritten, one interleaved run
    decode_ratio: float | None
    latency: dict | None
    windows: dict  # fit / selection / evaluation: count, tokens, and how many windows are the model's own samples
    estimate_placement: str | None = None  # where the estimate's kernels were profiled: the latency's device
    resumed: dict[str, int] = dataclasses.field(default_factory=dict)  # finished units read back from the work folder, by step
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time of the steps after the selection: evaluation
    checkpoints: dict = dataclasses.field(default_factory=dict)  # what writing the work folder's units cost: seconds, bytes, units

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["selection"] = self.selection.to_json()
        data["dnll_eval"] = self.dnll_eval.dnll
        data["dnll_eval_interval"] = [self.dnll_eval.low, self.dnll_eval.high]
        data["divergence_eval"] = self.divergence_eval.to_json()
        data["budget"] = dataclasses.asdict(self.selection.budget)  # the limits the picture draws
        return data


def auto(
    model_path: str | Path,
    out: str | Path,
    *,
    corpus: str | Path | None = None,
    seq_len: int = 256,
    windows: int = 16,
    fit_windows: int = 64,
    eval_windows: int = 32,
    fit: Fit | None = "full",
    fused: bool = False,
    measure_latency: bool = True,
    repeats: int = 20,
    tokenizer: str | Path | None = None,
    options: runtime.Options = runtime.Options(),
    progress: Tell | None = None,
    workers: int | None = None,
    ray: str | None = None,
    checkpoints: bool = True,
    restart: bool = False,
    **greedy,
) -> tuple[Outcome, Path]:
    """Select, rewrite, measure and write: the main job (`surgery parallelize --layers auto`).

    Args:
        model_path: the exported model: an .onnx file, or a folder holding one.
        out: where to write the rewritten model, like its input (`write`), with selection.json and its picture beside it; never the input.
        corpus: a .txt or .jsonl file (a `text` field per line); None: the built-in corpus.
        seq_len: tokens per window, and the prompt length the latency and the speed-up estimate are timed at.
        windows: selection windows (the greedy's checks), from the corpus's calibration part.
        fit_windows: fit windows (the fixes; with a fit), dealt from the calibration part with the selection windows, disjoint from them.
        eval_windows: evaluation windows, from the corpus's evaluation part (disjoint from both): the reported dNLL and KL are on them.
        fit: `full` (least-squares fix), `gate` (the paper's alpha_l) or None (no compensation), as select_layers.
        fused: write the chosen blocks in the fused parallel form (`fuse`) instead of plain or compensated parallel blocks.
        measure_latency: time the prefill and decode of the original and the rewritten model, interleaved.
        repeats: timed runs of each model for the latency.
        tokenizer: a tokenizer.json (or its folder) when the model's folder has none.
        options: ONNX Runtime session options, for every session.
        progress: called as progress(stage, done, total) as each stage advances.
        workers: score the selection's trials and the fit pass on a local Ray cluster of that many CPUs (the evaluation stays in this process).
        ray: the same on the Ray cluster at that address.
        checkpoints: keep the finished units (the fit's, each trial's, the evaluation's) in the work folder `OUT.work` beside the output, and
            resume from it when it holds an interrupted run of the same model, windows and options (surgery.checkpoint); a finished run removes it.
        restart: discard that work folder first instead of resuming from it.
        **greedy (Any): how select_layers chooses: score, budget, max_layers, patience, protect_first, protect_last, try_both, refit, fit_memory, ...

    Returns:
        The Outcome (selection.json's content: the Selection, the form written, dNLL and KL on the evaluation windows, speed-ups) and the .onnx path written.

    Raises:
        SurgeryError: `out` overwrites the input or cannot be written, a block cannot be fused (with `fused`; before any work), too small a corpus, or
            what select_layers refuses, or a work folder of another run (without `restart`).
    """
    tell = progress or silent
    subject = Subject(graph.load(model_path), str(model_path))  # read once: the selection, the rewrite and the measurements take it
    graph.check_output(out, model_path, subject.model)
    model, blocks = subject.model, subject.blocks
    if fused:  # before any work: a block that cannot be fused would fail only after the fit and the selection
        _check_fusable(model, blocks[greedy.get("protect_first", 0) : len(blocks) - greedy.get("protect_last", 0)])
    get = lambda part, count: data.windows(model_path, corpus, seq_len=seq_len, max_windows=count, part=part, tokenizer=tokenizer)  # noqa: E731
    if fit is not None:
        fit_part, sel = data.deal(get("calibration", fit_windows + windows), [fit_windows, windows], ["fit", "selection"])
    else:
        fit_part, sel = None, get("calibration", windows)
    ev = get("evaluation", eval_windows)
    parts, results = {"fit windows": fit_part, "selection windows": sel, "evaluation windows": ev}, {"fit": fit, "fused": fused, **greedy}
    with _work(out, model_path, model, parts, results, options, restart) if checkpoints else Checkpoints.off() as work:  # released however auto ends
        with cluster.pool(workers, ray, device=options.device) as pool:
            selection = select_layers(subject, sel, fit_windows=fit_part, fit=fit, options=options, progress=tell, pool=pool, work=work, **greedy)
        rewritten = rewrite(subject, selection.layers, fused=fused, fixes=selection.fixes).model
        base, after, seconds = _evaluation(model, rewritten, ev, options, tell, work)
        times = timing.branch_times(subject, seq_len=seq_len, runs=3, options=options)  # on the latency's device
        estimate = times.estimated_speedup(selection.layers)
        prefill, decode, timed = _latency(model, rewritten, seq_len=seq_len, repeats=repeats, options=options, tell=tell) if measure_latency else (None,) * 3
        described = {name: w.describe() for name, w in (("fit", fit_part), ("selection", sel), ("evaluation", ev)) if w is not None}
        outcome = Outcome(selection, selection.describe(fused), base.loss, evaluate.delta(base, after), ev.tokens, evaluate.divergence(after, base), estimate,
                          prefill, decode, timed, described, str(times.placement), work.resumed(), seconds, work.cost)
        written = _write(outcome, rewritten, out, model_path)
        work.finish()
    return outcome, written


def _write(outcome: Outcome, rewritten: ir.Model, out, model_path) -> Path:
    """Write the rewritten model like its input, with selection.json and its picture beside it (`MODEL.selection.json` for a file)."""
    report = "selection.json" if Path(model_path).is_dir() else Path(out).with_suffix(".selection.json").name
    saved = outcome.to_json()
    extra = {report: json.dumps(saved, indent=2), Path(report).with_suffix(".png").name: selection_picture(saved)}
    return graph.write(rewritten, out, like=model_path, extra=extra)


def _evaluation(model: ir.Model, rewritten: ir.Model, ev: data.Windows, options: runtime.Options, tell: Tell, work: Checkpoints
                ) -> tuple[evaluate.Perplexity, evaluate.Perplexity, dict[str, float]]:
    """The original's and the rewritten model's scores on the evaluation windows (a checkpoint unit), and the seconds
    they took. Sessions of models in memory hand their weights to ORT without serializing them (runtime.session)."""
    start = time.perf_counter()
    if (scored := work.load("evaluation")) is None:
        step = counter(tell, "evaluation windows", 2 * len(ev))
        scored = evaluate.compare([model, rewritten], ev, options=options, progress=lambda i, n: step(n))
        work.save("evaluation", scored)
    return *scored, {"evaluation": time.perf_counter() - start}


def _work(out, model_path, model: ir.Model, windows: dict[str, data.Windows | None], results: dict, options: runtime.Options,
          restart: bool) -> Checkpoints:
    """The main job's work folder beside `out`, tied to the model's bytes, the windows' tokens, the options that change
    results (`results` but the fit memory; the device) and surgery's version; not to those that change only speed."""
    fingerprint = {"model": model_digest(model_path, model),
                   **{name: digest(w.ids) for name, w in windows.items() if w is not None}, "device": runtime.providers(options.device)[0],
                   **{k: str(v) for k, v in results.items() if k != "fit_memory"}}
    return Checkpoints.open(out, fingerprint, restart=restart)


def _check_fusable(model: ir.Model, blocks: list[BlockMap]) -> None:
    """Refuse --fuse when one of the sequential `blocks` (those auto may choose) cannot be fused."""
    for block in blocks:
        if not block.is_parallel and (why := fuse_refusal(model, block)) is not None:
            raise SurgeryError(f"{why} (--fuse applies to every chosen block; drop --fuse or protect the block)")


def _latency(model: ir.Model, rewritten: ir.Model, *, seq_len: int, repeats: int, options: runtime.Options,
             tell: Tell) -> tuple[float, float | None, dict]:
    """Prefill and decode speed-ups (original / rewritten; decode None when either has no decode time) from one
    interleaved run of both, and the run's timings."""
    timed = timing.latency([model, rewritten], seq_len=seq_len, repeats=repeats, options=options,
                             progress=counter(tell, "latency (interleaved)", repeats))
    prefill = timed[0].prefill_ms / timed[1].prefill_ms
    decode = timed[0].decode_ms / timed[1].decode_ms if timed[0].decode_ms and timed[1].decode_ms else None
    return prefill, decode, {"original": dataclasses.asdict(timed[0]), "rewritten": dataclasses.asdict(timed[1])}
