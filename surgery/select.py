"""--layers auto: choose the sequential blocks to make parallel, greedily, by a one-pass defect score.

Rank sequential blocks by the score (lowest first; C_l^stream by default, the better predictor of
single-layer dNLL on SmolLM2-135M: Spearman 0.67 vs 0.52 for C_l, benchmarks/RESULTS.md), then add
them one at a time, measuring the dNLL of the whole chosen set on the calibration windows; keep a
block while that stays within max_loss_increase, skip it otherwise, stop at max_layers.
Cost: one probe pass for all scores, one baseline pass, one pass per candidate tried, each over
the calibration windows, all in one switchboard session.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from surgery import data, evaluate, graph, runtime
from surgery.blocks import find_blocks
from surgery.data import Windows
from surgery.diagnostics import defect, graphs
from surgery.errors import SurgeryError
from surgery.passes import Fix, fuse, parallelize, project

SCORES = ("c_stream", "c")
Progress = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True)
class Trial:
    layer: int
    score: float
    dnll: float  # of the chosen set plus this layer, calibration windows
    kept: bool


@dataclasses.dataclass(frozen=True)
class Selection:
    layers: tuple[int, ...]
    score: str
    c: tuple[float | None, ...]
    c_stream: tuple[float | None, ...]
    alpha: tuple[float | None, ...]
    trials: tuple[Trial, ...]
    base_loss: float  # calibration windows
    dnll: float  # of the chosen set, calibration windows
    forward_passes: int  # over the calibration windows: scores + baseline + one per candidate


def select_layers(
    model: ir.Model,
    windows: Windows,
    *,
    score: str = "c_stream",
    max_loss_increase: float = 0.02,
    max_layers: int | None = None,
    protect_first: int = 0,
    protect_last: int = 0,
    options: runtime.Options = runtime.Options(),
    progress: Progress | None = None,
) -> Selection:
    """Greedy selection of blocks to parallelize (see the module docstring)."""
    if score not in SCORES:
        raise SurgeryError(f"unknown score {score!r}; use one of {', '.join(SCORES)}")
    tell = progress or (lambda stage, done, total: None)
    blocks = find_blocks(model)
    n = len(blocks)
    stats = defect.scores(model, windows, options, lambda d, t: tell("defect scores", d, t))
    candidates = [
        b.layer for b in blocks
        if not b.is_parallel and protect_first <= b.layer < n - protect_last and stats[score][b.layer] is not None
    ]
    candidates.sort(key=lambda layer: stats[score][layer])
    kinds = [("parallel",)]
    scorer = evaluate.Scorer(graphs.switchboard(model, kinds), options)

    def loss(layers) -> float:
        return scorer(windows, extra={graphs.SWITCHES: graphs.switches(kinds, n, {kinds[0]: set(layers)})}).loss

    base = loss(())
    chosen: list[int] = []
    trials: list[Trial] = []
    dnll = 0.0
    for i, layer in enumerate(candidates):
        if max_layers is not None and len(chosen) >= max_layers:
            break
        trial = loss(chosen + [layer]) - base
        kept = trial <= max_loss_increase
        trials.append(Trial(layer, float(stats[score][layer]), trial, kept))
        if kept:
            chosen.append(layer)
            dnll = trial
        tell("greedy selection", i + 1, len(candidates))
    return Selection(
        layers=tuple(sorted(chosen)),
        score=score,
        c=tuple(stats["c"]),
        c_stream=tuple(stats["c_stream"]),
        alpha=tuple(stats["alpha"]),
        trials=tuple(trials),
        base_loss=base,
        dnll=dnll,
        forward_passes=2 + len(trials),
    )


def gates(model: ir.Model, model_path, layers, *, corpus=None, seq_len=256, windows=4, tokenizer=None, options=runtime.Options()) -> dict[int, float]:
    """alpha_l of the given sequential blocks, from one probe pass over the calibration windows."""
    cal = data.windows(model_path, corpus, seq_len=seq_len, max_windows=windows, part="calibration", tokenizer=tokenizer)
    alpha = defect.scores(model, cal, options)["alpha"]
    return {layer: alpha[layer] for layer in layers if alpha[layer] is not None}


def rewrite(model: ir.Model, layers, *, fused: bool = False, alpha: dict[int, float] | None = None):
    """Make `layers` parallel: plain (ln2 reads resid_pre) or fused; with `alpha`, scale each one's
    mlp output by alpha_l (the calibrated parallel block). Returns a SurgeryResult."""
    if fused:
        return fuse(model, layers, {l: Fix.gate(a) for l, a in (alpha or {}).items()})
    result = parallelize(model, layers)
    changes = {c.layer: c for c in result.changes}
    for layer, factor in sorted((alpha or {}).items()):
        scaled = project(result.model, "mlp", "scale", {layer}, factor)
        result = dataclasses.replace(result, model=scaled.model)
        what = changes[layer].what if changes[layer].applied else "parallel"
        changes[layer] = dataclasses.replace(changes[layer], what=f"{what}, mlp_out x alpha {factor:.4f}", applied=True)
    return dataclasses.replace(result, changes=tuple(changes[l] for l in sorted(changes)))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `surgery parallelize --layers auto` reports and writes to selection.json."""

    selection: Selection
    form: str  # "plain", "fused", "calibrated", "fused calibrated"
    base_loss_eval: float
    dnll_eval: float
    eval_tokens: int
    estimated_speedup: float  # the paper's max(t_attn, t_mlp) estimate, from per-branch kernel times
    prefill_ratio: float | None  # original / rewritten, one interleaved run
    decode_ratio: float | None
    latency: dict | None

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["selection"]["trials"] = [dataclasses.asdict(t) for t in self.selection.trials]
        return data


def auto(
    model_path,
    out,
    *,
    corpus=None,
    seq_len: int = 256,
    windows: int = 4,
    eval_windows: int = 8,
    score: str = "c_stream",
    max_loss_increase: float = 0.02,
    max_layers: int | None = None,
    protect_first: int = 0,
    protect_last: int = 0,
    fused: bool = False,
    calibrate: bool = False,
    measure_latency: bool = True,
    repeats: int = 20,
    tokenizer=None,
    options: runtime.Options = runtime.Options(),
    progress: Progress | None = None,
) -> tuple[Outcome, Path]:
    """Select, rewrite, measure and write: the main job. Returns the outcome and the written .onnx path."""
    tell = progress or (lambda stage, done, total: None)
    model = graph.load(model_path)
    cal = data.windows(model_path, corpus, seq_len=seq_len, max_windows=windows, part="calibration", tokenizer=tokenizer)
    ev = data.windows(model_path, corpus, seq_len=seq_len, max_windows=eval_windows, part="evaluation", tokenizer=tokenizer)
    selection = select_layers(
        model, cal, score=score, max_loss_increase=max_loss_increase, max_layers=max_layers,
        protect_first=protect_first, protect_last=protect_last, options=options, progress=tell,
    )
    alpha = {l: selection.alpha[l] for l in selection.layers} if calibrate else None
    rewritten = rewrite(model, selection.layers, fused=fused, alpha=alpha).model
    # The original runs from its file: no re-serialisation of an unchanged model.
    base = evaluate.perplexity(model_path, ev, options=options, progress=lambda n: tell("evaluation windows", n, 2 * len(ev)))
    after = evaluate.perplexity(rewritten, ev, options=options)
    tell("evaluation windows", 2 * len(ev), 2 * len(ev))
    estimate = evaluate.branch_times(model, seq_len=seq_len).estimated_speedup(selection.layers)
    prefill = decode = timing = None
    if measure_latency:
        timed = evaluate.latency([model_path, rewritten], seq_len=seq_len, repeats=repeats, options=options,
                                 progress=lambda n: tell("latency (interleaved)", n, repeats))
        prefill = timed[0].prefill_ms / timed[1].prefill_ms
        decode = timed[0].decode_ms / timed[1].decode_ms if timed[0].decode_ms and timed[1].decode_ms else None
        timing = {"original": dataclasses.asdict(timed[0]), "rewritten": dataclasses.asdict(timed[1])}
    form = " ".join(w for w, on in (("fused", fused), ("calibrated", calibrate)) if on) or "plain"
    outcome = Outcome(selection, form, base.loss, after.loss - base.loss, ev.tokens, estimate, prefill, decode, timing)
    written = graph.write(rewritten, out, like=model_path)
    report = written.parent / "selection.json" if Path(model_path).is_dir() else written.with_suffix(".selection.json")
    partial = report.with_name(f".{report.name}.partial")
    partial.write_text(json.dumps(outcome.to_json(), indent=2))
    partial.replace(report)
    return outcome, written
