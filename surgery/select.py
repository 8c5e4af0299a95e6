"""--layers auto: choose the sequential blocks to make parallel, greedily, by a one-pass score.

With compensation (the default), one streamed pass over the fit windows fits every block's fix
(surgery.compensation) and gives every score: C_l, C_l^stream, alpha_l and C_l^comp, the fixed
block's held-out defect. Blocks are ranked by the score (lowest first: C_l^comp when compensating,
C_l^stream otherwise) and added one at a time, measuring the whole chosen set against the original
on the selection windows, which are disjoint from the fit windows and from the evaluation windows:
mean token KL (the original's log-probs of each selection batch are kept from the baseline pass)
and dNLL. A candidate is kept while both stay within the Budget (--max-kl, --max-loss-increase; on
point estimates). It is tried compensated first; plain is tried after it when that misses the
budget and the fit did not lower the held-out defect (residual fraction >= 1), so a bad fit costs
one try; with try_both every candidate is tried in both forms and the better passing one (lower
KL) is kept. With refit, the chosen blocks' fixes are then fitted again with every chosen block in
place, and the refitted fixes are kept if the selection KL goes down. All trials run in one
switchboard session; a refit builds a second one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from surgery import cluster, compensation, data, evaluate, graph, runtime
from surgery.analysis import resumable
from surgery.analysis import switchboard as board_graph
from surgery.analysis.fit_graph import KINDS
from surgery.analysis.probe import defect_scores
from surgery.blocks import find_blocks
from surgery.data import Windows
from surgery.equations import FitResult
from surgery.errors import SurgeryError
from surgery.evaluate import Delta
from surgery.facts import embedding_table, stream_dtype
from surgery.passes import Fix, compensate, fuse, parallelize
from surgery.passes.common import narrower_than_float32
from surgery.passes.fuse import refusal as fuse_refusal

SCORES = ("c_comp", "c_stream", "c")
FITS = ("full", "gate")  # least-squares fix, or the paper's scalar gate alpha_l (--calibrate)
Progress = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True)
class Trial:
    layer: int
    form: str  # "compensated" or "plain"
    score: float
    dnll: float  # of the chosen set plus this layer in this form, selection windows
    low: float  # 95 % paired bootstrap interval over the selection windows
    high: float
    kept: bool
    kl: float  # mean token KL(original || chosen set plus this layer), selection windows
    kl_low: float  # its 95 % bootstrap interval over the selection windows
    kl_high: float
    top1: float  # top-1 agreement with the original


@dataclasses.dataclass(frozen=True)
class Budget:
    """What the chosen set may cost on the selection windows, on point estimates: mean token KL vs the original
    (nats) and dNLL (nats); None switches a limit off. Both must hold."""

    max_kl: float | None = 0.05
    max_loss_increase: float | None = 0.02

    def __post_init__(self):
        for flag, limit in (("--max-kl", self.max_kl), ("--max-loss-increase", self.max_loss_increase)):
            if limit is not None and not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
                raise SurgeryError(f"{flag} {limit}: give a positive number of nats, or `none` to switch the limit off")

    @staticmethod
    def parse(max_kl: str | float | None, max_loss_increase: str | float | None) -> "Budget":
        """A Budget from command-line values: numbers, or `none`."""
        def read(flag, text):
            if text is None or str(text).strip().lower() == "none":
                return None
            try:
                return float(text)
            except ValueError:
                raise SurgeryError(f"cannot read {flag} {text!r}: give a positive number of nats, or `none`") from None

        return Budget(read("--max-kl", max_kl), read("--max-loss-increase", max_loss_increase))

    def __str__(self) -> str:
        limits = [f"KL <= {self.max_kl}" if self.max_kl is not None else "", f"dNLL <= {self.max_loss_increase}" if self.max_loss_increase is not None else ""]
        return " and ".join(x for x in limits if x) or "no limit"

    def holds(self, d: Delta, kl: evaluate.Divergence) -> bool:
        return (self.max_kl is None or kl.kl <= self.max_kl) and (self.max_loss_increase is None or d.dnll <= self.max_loss_increase)

    def cost(self, d: Delta, kl: evaluate.Divergence) -> float:
        """What "better" means between passing forms or fixes: KL when it is limited, else dNLL."""
        return kl.kl if self.max_kl is not None or self.max_loss_increase is None else d.dnll


@dataclasses.dataclass(frozen=True)
class Selection:
    layers: tuple[int, ...]
    forms: dict[int, str]  # layer -> "compensated" or "plain"
    score: str
    fit: str | None  # "full", "gate", or None (no compensation)
    c: tuple[float | None, ...]
    c_stream: tuple[float | None, ...]
    c_comp: tuple[float | None, ...]
    alpha: tuple[float | None, ...]
    fits: dict[int, FitResult]
    trials: tuple[Trial, ...]
    base_loss: float  # selection windows
    dnll: Delta  # of the chosen set, selection windows
    divergence: evaluate.Divergence | None  # of the chosen set vs the original, selection windows (None: nothing chosen)
    refit: dict | None  # what the sequential refit did, when asked for
    fit_passes: int  # over the fit windows: one per chunk of layers whose normal equations fit in memory (+ the refit's)
    forward_passes: int  # over the selection windows: baseline + one per trial (+ 1 for a refit)
    seconds: dict[str, float]
    fit_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # the fit's (and refit's) forward / accumulate / solve
    candidates: int = 0  # sequential blocks that could be chosen, ranked
    stopped: str | None = None  # why the greedy stopped before the last candidate
    fit_memory: int | None = None  # the bytes one fit pass's normal equations could take (--fit-memory)
    requantize: str | None = None  # how chosen compensated MatMulNBits blocks' codes were chosen (None: none is chosen)
    blocks_run: int = 0  # blocks the forward passes ran (a resumed trial runs the blocks from its start on; the rest all)

    @property
    def uncompensated(self) -> dict[int, str]:
        """Each chosen block written plain although compensation was asked for because its fix could not be
        made (a failed fit, or weights it cannot be folded into) -> why. Plain chosen on measurement is not here."""
        if self.fit is None:
            return {}
        return {l: self.fits[l].note or "no fix" for l in self.layers if self.forms[l] == "plain" and l in self.fits and self.fits[l].fix is None}

    def counts(self) -> dict[str, int]:
        """How many chosen blocks were written in each form."""
        return {f: sum(1 for v in self.forms.values() if v == f) for f in ("compensated", "plain")}

    @property
    def fixes(self) -> dict[int, Fix]:
        """The fix of each block chosen in compensated form."""
        return {l: self.fits[l].fix for l in self.layers if self.forms[l] == "compensated"}

    def to_json(self) -> dict:
        blocks = []
        for layer in range(len(self.c)):
            if self.c[layer] is None:
                continue
            fit = self.fits.get(layer)
            blocks.append({
                "layer": layer,
                "form": self.forms.get(layer, "sequential"),
                "c": self.c[layer], "c_stream": self.c_stream[layer], "c_comp": self.c_comp[layer], "alpha": self.alpha[layer],
                "fit": None if fit is None else {k: v for k, v in fit.to_json().items() if k != "scores"},
                "trials": [dataclasses.asdict(t) for t in self.trials if t.layer == layer],
            })
        return {
            "layers": list(self.layers), "forms": {str(k): v for k, v in sorted(self.forms.items())},
            "score": self.score, "fit": self.fit, "base_loss": self.base_loss, "dnll": self.dnll.to_json(),
            "divergence": None if self.divergence is None else self.divergence.to_json(),
            "candidates": self.candidates, "stopped": self.stopped, "refit": self.refit,
            "uncompensated": {str(k): v for k, v in self.uncompensated.items()},
            "fit_passes": self.fit_passes, "fit_memory": self.fit_memory, "fit_seconds": self.fit_seconds, "forward_passes": self.forward_passes,
            "blocks_run": self.blocks_run,
            "requantize": self.requantize,
            "seconds": self.seconds, "blocks": blocks, "trials": [dataclasses.asdict(t) for t in self.trials],
        }


BATCH = 4  # selection windows scored together: one job for a Ray actor
PATIENCE = 6  # auto stops after this many candidates in a row miss the budget
KEEP_BYTES = 1 << 30  # the streams a resumed selection keeps (checkpoints): at most this, or an eighth of the available memory


class TrialScorer(evaluate.Scorer):
    """A switchboard's scoring session (here or on a Ray actor) that runs one batch of selection windows at a time."""

    def run(self, windows: Windows, extra: dict, reference=None) -> tuple[evaluate.Perplexity, dict | None, list | None]:
        """The batch's score (KL and top-1 against `reference`, when given); the streams it keeps; without a reference,
        its own log-probs (the original's Reference of the batch)."""
        kept, record = ({} if self.keep else None), ([] if reference is None else None)
        scored = self(windows, batch_size=len(windows), extra=extra, kept=kept, reference=None if reference is None else [reference], record=record)
        return scored, kept, record


class Trials:
    """The selection's trials: the switchboard of KINDS with the fixes in one scoring session, each trial the whole
    chosen set against the original on the selection windows, in batches of BATCH.

    Resumed (in this process, float32 or wider, when the graph allows: resumable.resumable): the session keeps the
    residual stream of the set accepted so far at checkpoint blocks (the candidates' blocks, as many as KEEP_BYTES
    holds), and a trial that adds block l to it starts at the last checkpoint <= l, from that stream, since no block
    before l differs from the accepted set's. A trial then costs the blocks from there on and the logits."""

    def __init__(self, model: ir.Model, fixes: dict[int, Fix], windows: Windows, candidates: list[int], pool: cluster.Pool,
                 options: runtime.Options, baseline: "Trials | None" = None):
        """baseline: Trials of the same model and windows whose unchanged run to reuse (no resumed trials then)."""
        blocks = find_blocks(model)
        self.n = len(blocks)
        board = board_graph.switchboard(model, KINDS, fixes)
        resume = None
        if baseline is None and not pool.distributed and not narrower_than_float32(stream_dtype(model).numpy()):
            resume = resumable.resumable(board, blocks)
        self.batches = [windows.take(range(i, min(i + BATCH, len(windows)))) for i in range(0, len(windows), BATCH)]
        self.resume, self.checkpoints = resume, ()
        if resume is not None:
            per_block = windows.ids.size * stream_dtype(model).numpy().itemsize * embedding_table(model)[1]
            room = max(1, min(KEEP_BYTES, (compensation.available_memory() or KEEP_BYTES * 8) // 8) // max(per_block, 1))
            layers = sorted({l for l in candidates if 0 < l < self.n})
            self.checkpoints = tuple(layers[i] for i in data.spread(len(layers), room))
        keep = tuple(resume.resid_post[c - 1] for c in self.checkpoints) if resume else ()
        make = functools.partial(TrialScorer, options=pool.options(options), compare=True, keep=keep)
        self.scorers = pool.actors(resume.model if resume else board, make)
        self.passes, self.blocks_run = 0, 0
        self.streams: list[dict] = [{} for _ in self.batches]  # per batch: the accepted set's stream at each checkpoint
        self.base, self.reference = (baseline.base, baseline.reference) if baseline else self._baseline()

    def _baseline(self) -> tuple[evaluate.Perplexity, list]:
        parts = list(self.scorers.map("run", [(batch, self._extra({}, 0, b)) for b, batch in enumerate(self.batches)]))
        self.passes, self.blocks_run = self.passes + 1, self.blocks_run + self.n
        self.streams = [kept or {} for _, kept, _ in parts]
        reference = [self.scorers.share(r) for _, _, refs in parts for r in refs]  # [BATCH, seq, vocab] float32, sent to Ray actors once
        return evaluate.joined([p for p, _, _ in parts]), reference

    def _extra(self, on: dict, start: int, batch: int) -> dict:
        extra = {board_graph.SWITCHES: board_graph.switches(KINDS, self.n, on)}
        return extra | self.resume.inputs(start, self.streams[batch]) if self.resume else extra

    def start(self, layer: int) -> int:
        """Where a trial adding `layer` to the accepted set starts: the last checkpoint at or before it, or block 0."""
        return max((c for c in self.checkpoints if c <= layer), default=0)

    def loss(self, forms: dict[int, str], new: int | None = None) -> tuple[Delta, evaluate.Divergence, dict]:
        """dNLL and KL of the blocks in `forms` against the original; `new`: the one block `forms` adds to the accepted
        set (None: run from block 0). Also what `accept` needs to make it the accepted set."""
        start = 0 if new is None else self.start(new)
        on = {KINDS[0]: set(forms), KINDS[1]: {l for l, f in forms.items() if f == "compensated"}}
        jobs = [(batch, self._extra(on, start, b), ref) for b, (batch, ref) in enumerate(zip(self.batches, self.reference))]
        parts = list(self.scorers.map("run", jobs))
        self.passes += 1
        self.blocks_run += self.n - start
        p = evaluate.joined([part for part, _, _ in parts])
        return evaluate.delta(self.base, p), evaluate.divergence(p), {"start": start, "kept": [kept for _, kept, _ in parts]}

    def accept(self, trial: dict) -> None:
        """Make a trial's set the accepted one: the streams at checkpoints after its start come from its run."""
        if not self.resume:
            return
        later = {self.resume.resid_post[c - 1] for c in self.checkpoints if c > trial["start"]}
        for streams, kept in zip(self.streams, trial["kept"]):
            streams.update({name: kept[name] for name in later})


def select_layers(
    model: ir.Model,
    windows: Windows,
    *,
    fit_windows: Windows | None = None,
    fit: str | None = "full",
    score: str | None = None,
    budget: Budget = Budget(),
    max_layers: int | None = None,
    patience: int | None = PATIENCE,
    protect_first: int = 0,
    protect_last: int = 0,
    try_both: bool = False,
    refit: bool = False,
    options: runtime.Options = runtime.Options(),
    progress: Progress | None = None,
    pool: cluster.Pool = cluster.Pool(),
    fit_memory: int | str | None = None,
    requantize: str = "gptq",
    input_side: bool = True,
) -> Selection:
    """Greedy selection of blocks to parallelize (see the module docstring). `windows` are the
    selection windows; `fit_windows` (needed when `fit` is set) are where the fixes are fitted.
    patience: stop after this many candidates in a row miss the budget (None or 0: try them all).
    pool: where the fit's windows and each trial's batches of selection windows are run (Ray actors, or this process).
    fit_memory: the bytes one fit pass's normal equations may take (compensation.memory_bound: None is auto).
    requantize: how fixes folded into MatMulNBits weights choose their codes (compensation.REQUANTIZE).
    input_side: full fixes get an mlp input side where it folds (compensation.fit)."""
    score = score or ("c_comp" if fit else "c_stream")
    if score not in SCORES:
        raise SurgeryError(f"unknown score {score!r}; use one of {', '.join(SCORES)}")
    if fit is not None and fit not in FITS:
        raise SurgeryError(f"unknown fit {fit!r}; use one of {', '.join(FITS)}")
    if fit is None and score == "c_comp":
        raise SurgeryError("score c_comp needs compensation; use c_stream or c with --no-compensate")
    if fit is not None and fit_windows is None:
        raise SurgeryError("compensation needs fit windows, disjoint from the selection windows")
    tell = progress or (lambda stage, done, total: None)
    blocks = find_blocks(model)
    n = len(blocks)
    seconds: dict[str, float] = {}
    fit_seconds: dict[str, float] = {}  # where the fit's time went: forward, accumulate, solve
    memory = compensation.memory_bound(fit_memory) if fit is not None else None
    start = time.perf_counter()
    if fit is not None:
        fit_passes = compensation.passes(model, memory_bytes=memory, pool=pool, requantize=requantize, kind=fit, input_side=input_side)
        fits = compensation.fit(model, fit_windows, kind=fit, options=options, memory_bytes=memory, pool=pool, seconds=fit_seconds, requantize=requantize,
                                input_side=input_side,
                                progress=lambda d, t: tell(f"fit ({fit_passes} pass{'es' if fit_passes > 1 else ''})", d, t))
        stats = {k: [fits[l].scores[k] if l in fits else None for l in range(n)] for k in ("c", "c_stream", "alpha")}
        stats["c_comp"] = [fits[l].c_comp if l in fits and fits[l].fix is not None else None for l in range(n)]
    else:
        fits, fit_passes = {}, 0
        stats = defect_scores(model, windows, options, lambda d, t: tell("defect scores", d, t))
        stats["c_comp"] = [None] * n
    seconds["fit" if fit else "scores"] = time.perf_counter() - start

    start = time.perf_counter()
    # A block without a fix (a failed fit, or weights it cannot be folded into) can only be written plain: its plain score ranks it.
    rank = [stats[score][l] if stats[score][l] is not None or score != "c_comp" else stats["c_stream"][l] for l in range(n)]
    candidates = [
        b.layer for b in blocks
        if not b.is_parallel and protect_first <= b.layer < n - protect_last and rank[b.layer] is not None
    ]
    candidates.sort(key=lambda layer: rank[layer])
    fixes = {l: f.fix for l, f in fits.items() if f.fix is not None}
    runs = Trials(model, fixes, windows, candidates, pool, options)
    base = runs.base

    chosen: dict[int, str] = {}
    trials: list[Trial] = []
    current, current_kl = Delta(0.0, 0.0, 0.0), None
    misses, stopped = 0, None  # candidates rejected in a row; why the greedy stopped before the end of the list
    for i, layer in enumerate(candidates):
        if max_layers is not None and len(chosen) >= max_layers:
            stopped = f"--max-layers {max_layers} reached"
            break
        if patience and misses >= patience:
            stopped = f"{patience} candidates in a row missed the budget"
            break
        passing = []
        for form in _forms(layer, fits, try_both):
            d, kl, run = runs.loss({**chosen, layer: form}, new=layer)
            trials.append(Trial(layer, form, float(rank[layer]), d.dnll, d.low, d.high, False, kl.kl, kl.low, kl.high, kl.top1))
            if budget.holds(d, kl):
                passing.append((budget.cost(d, kl), form, d, kl, len(trials) - 1, run))
                if not try_both:
                    break
        misses = 0 if passing else misses + 1
        if passing:
            _, form, current, current_kl, index, run = min(passing, key=lambda p: p[0])
            chosen[layer] = form
            runs.accept(run)
            trials[index] = dataclasses.replace(trials[index], kept=True)
        tell("greedy selection", i + 1, len(candidates))
    seconds["selection"] = time.perf_counter() - start

    refit_report, refitted = None, None
    compensated = {l for l, f in chosen.items() if f == "compensated"}
    if refit and compensated:
        start = time.perf_counter()
        on = {KINDS[0]: set(chosen), KINDS[1]: compensated}
        fit_passes += compensation.passes(model, compensated, memory, pool, requantize, input_side=False)  # they keep theirs
        again = compensation.fit(model, fit_windows, compensated, fixes=fixes, on=on, kind=fit, options=options, memory_bytes=memory, pool=pool,
                                 requantize=requantize,
                                 seconds=fit_seconds, progress=lambda d, t: tell("refit", d, t))
        new_fits = {**fits, **{l: f for l, f in again.items() if f.fix is not None}}
        new_fixes = {l: f.fix for l, f in new_fits.items() if f.fix is not None}
        refitted = Trials(model, new_fixes, windows, [], pool, options, baseline=runs)
        d, kl, _ = refitted.loss(chosen)
        kept = budget.cost(d, kl) < budget.cost(current, current_kl)
        refit_report = {"layers": sorted(again), "dnll_before": current.to_json(), "dnll_after": d.to_json(),
                        "kl_before": current_kl.to_json(), "kl_after": kl.to_json(), "kept": kept}
        if kept:
            fits, current, current_kl = new_fits, d, kl
        seconds["refit"] = time.perf_counter() - start
    return Selection(
        layers=tuple(sorted(chosen)),
        forms=dict(sorted(chosen.items())),
        score=score,
        fit=fit,
        c=tuple(stats["c"]),
        c_stream=tuple(stats["c_stream"]),
        c_comp=tuple(stats["c_comp"]),
        alpha=tuple(stats["alpha"]),
        fits=fits,
        trials=tuple(trials),
        base_loss=base.loss,
        dnll=current,
        divergence=current_kl,
        refit=refit_report,
        fit_passes=fit_passes,
        fit_seconds=fit_seconds,
        forward_passes=runs.passes + (refitted.passes if refitted else 0),
        blocks_run=runs.blocks_run + (refitted.blocks_run if refitted else 0),
        seconds=seconds,
        candidates=len(candidates),
        stopped=stopped,
        fit_memory=memory,
        requantize=requantize if set(compensation.quantized_outputs(model)) & {l for l, f in chosen.items() if f == "compensated"} else None,
    )


def _form(selection: Selection, fused: bool) -> str:
    """What was written, in words: `compensated`, `calibrated`, `plain`, `compensated and plain` (maybe `fused ...`), or `none`."""
    counts = selection.counts()
    fixed = {"full": "compensated", "gate": "calibrated", None: "plain"}[selection.fit]
    if not selection.layers:
        return "none"
    kinds = [k for k, c in ((fixed, counts["compensated"]), ("plain", counts["plain"])) if c]
    return ("fused " if fused else "") + " and ".join(dict.fromkeys(kinds))


def _forms(layer: int, fits: dict[int, FitResult], try_both: bool) -> tuple[str, ...]:
    """The forms to try for a candidate, in order. Compensated first when it has a fix; plain after
    it only with try_both, or when the fit does not lower the held-out defect (a bad fit)."""
    f = fits.get(layer)
    if f is None or f.fix is None:
        return ("plain",)
    return ("compensated", "plain") if try_both or f.residual is None or f.residual >= 1.0 else ("compensated",)


def fit_fixes(model: ir.Model, model_path, layers, *, fit: str = "full", corpus=None, seq_len=256, fit_windows=64,
              tokenizer=None, options=runtime.Options(), fit_memory: int | str | None = None, requantize: str = "gptq",
              input_side: bool = True) -> dict[int, Fix]:
    """The fixes of the given sequential blocks, fitted in one pass over calibration windows (explicit --layers).
    A block whose fit fails is an error: compensation was asked for, so it is never silently written plain."""
    windows = data.windows(model_path, corpus, seq_len=seq_len, max_windows=fit_windows, part="calibration", tokenizer=tokenizer)
    fits = compensation.fit(model, windows, set(layers), kind=fit, options=options, memory_bytes=compensation.memory_bound(fit_memory),
                            requantize=requantize, input_side=input_side)
    for layer, f in sorted(fits.items()):
        if f.fix is None:
            raise SurgeryError(f"cannot compensate block {layer}: {f.note}; or parallelize it plain with --no-compensate")
    return {l: f.fix for l, f in fits.items()}


def rewrite(model: ir.Model, layers, *, fused: bool = False, fixes: dict[int, Fix] | None = None):
    """Make `layers` parallel, plain (ln2 reads resid_pre) or fused; the layers in `fixes` get their
    fix folded into the output projections (compensated, or calibrated with Fix.gate). Returns a SurgeryResult."""
    fixes = {l: f for l, f in (fixes or {}).items() if l in set(layers)}
    if fused:
        return fuse(model, layers, fixes)
    first = compensate(model, fixes) if fixes else None
    rest = parallelize(first.model if first else model, [l for l in layers if l not in fixes])
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
    divergence_eval: evaluate.Divergence  # KL vs the original, p99, top-1 agreement on the evaluation windows
    estimated_speedup: float  # the paper's max(t_attn, t_mlp) estimate, from per-branch kernel times
    prefill_ratio: float | None  # original / rewritten, one interleaved run
    decode_ratio: float | None
    latency: dict | None
    windows: dict  # fit / selection / evaluation: count and tokens
    estimate_placement: str | None = None  # where the estimate's kernels were profiled: the latency's device

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["selection"] = self.selection.to_json()
        data["dnll_eval"] = self.dnll_eval.dnll
        data["dnll_eval_interval"] = [self.dnll_eval.low, self.dnll_eval.high]
        data["divergence_eval"] = self.divergence_eval.to_json()
        return data


def auto(
    model_path,
    out,
    *,
    corpus=None,
    seq_len: int = 256,
    windows: int = 16,
    fit_windows: int = 64,
    eval_windows: int = 8,
    fit: str | None = "full",
    fused: bool = False,
    measure_latency: bool = True,
    repeats: int = 20,
    tokenizer=None,
    options: runtime.Options = runtime.Options(),
    progress: Progress | None = None,
    workers: int | None = None,
    ray: str | None = None,
    **greedy,
) -> tuple[Outcome, Path]:
    """Select, rewrite, measure and write: the main job. Returns the outcome and the written .onnx path.
    greedy: how select_layers chooses (score, budget, max_layers, patience, protect_first, protect_last,
    try_both, refit). workers / ray: the selection's trials are scored on a local Ray cluster of that many
    CPUs / on the Ray cluster at that address, and so is the fit pass (the evaluation stays in this process).

    Calibration windows are dealt into fit windows (the fixes) and selection windows (the greedy
    dNLL checks); the reported dNLL is on the disjoint evaluation windows.
    """
    tell = progress or (lambda stage, done, total: None)
    model = graph.load(model_path)
    graph.check_output(out, model_path, model)
    blocks = find_blocks(model, where=str(model_path))
    if fused:  # before any work: a block that cannot be fused would fail only after the fit and the selection
        for block in blocks[greedy.get("protect_first", 0) : len(blocks) - greedy.get("protect_last", 0)]:
            if not block.is_parallel and (why := fuse_refusal(model, block)) is not None:
                raise SurgeryError(f"{why} (--fuse applies to every chosen block; drop --fuse or protect the block)")
    get = lambda part, count: data.windows(model_path, corpus, seq_len=seq_len, max_windows=count, part=part, tokenizer=tokenizer)  # noqa: E731
    if fit is not None:
        fit_part, sel = data.deal(get("calibration", fit_windows + windows), [fit_windows, windows], ["fit", "selection"])
    else:
        fit_part, sel = None, get("calibration", windows)
    ev = get("evaluation", eval_windows)
    with cluster.pool(workers, ray, device=options.device) as pool:
        selection = select_layers(model, sel, fit_windows=fit_part, fit=fit, options=options, progress=tell, pool=pool, **greedy)
    rewritten = rewrite(model, selection.layers, fused=fused, fixes=selection.fixes).model
    # Sessions of models in memory hand their weights to ORT without serializing them (runtime.session).
    step = evaluate.counter(tell, "evaluation windows", 2 * len(ev))
    base, after = evaluate.compare([model, rewritten], ev, options=options, progress=lambda i, n: step(n))
    times = evaluate.branch_times(model, seq_len=seq_len, runs=3, options=options)  # on the latency's device
    estimate = times.estimated_speedup(selection.layers)
    prefill = decode = timing = None
    if measure_latency:
        timed = evaluate.latency([model, rewritten], seq_len=seq_len, repeats=repeats, options=options,
                                 progress=evaluate.counter(tell, "latency (interleaved)", repeats))
        prefill = timed[0].prefill_ms / timed[1].prefill_ms
        decode = timed[0].decode_ms / timed[1].decode_ms if timed[0].decode_ms and timed[1].decode_ms else None
        timing = {"original": dataclasses.asdict(timed[0]), "rewritten": dataclasses.asdict(timed[1])}
    form = _form(selection, fused)
    described = {name: {"count": len(w), "tokens": w.tokens} for name, w in (("fit", fit_part), ("selection", sel), ("evaluation", ev)) if w is not None}
    outcome = Outcome(selection, form, base.loss, evaluate.delta(base, after), ev.tokens, evaluate.divergence(after), estimate, prefill, decode,
                      timing, described, str(times.placement))
    report = "selection.json" if Path(model_path).is_dir() else Path(out).with_suffix(".selection.json").name
    written = graph.write(rewritten, out, like=model_path, extra={report: json.dumps(outcome.to_json(), indent=2)})
    return outcome, written
