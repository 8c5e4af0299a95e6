"""--layers auto: choose the sequential blocks to make parallel, greedily, by a one-pass score.

With compensation (the default), one streamed pass over the fit windows fits every block's fix
(surgery.compensation.fitting) and gives every score: C_l, C_l^stream, alpha_l and C_l^comp, the fixed
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
switchboard session (surgery.jobs.trials); a refit builds a second one.

With a frontier (SelectionSettings.frontier), the walk of surgery.jobs.greedy goes on past the budget in the same
session. Holds the result type (Selection) and select_layers; the greedy, its Budget and Trial are surgery.jobs.greedy;
the main job that loads, selects, rewrites, measures and writes is surgery.jobs.job.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Literal, get_args

import onnx_ir as ir

from surgery import compensation
from surgery.analysis.fit_graph import Form
from surgery.analysis.probe import defect_scores
from surgery.compensation import requantization
from surgery.compensation.equations import FitResult
from surgery.compensation.equations import fixes as fixes_of
from surgery.compensation.fitting import FitSettings, Kind
from surgery.engine import cluster, runtime
from surgery.engine.progress import Tell, silent
from surgery.errors import SurgeryError
from surgery.files.checkpoint import Checkpoints
from surgery.jobs.frontier import FrontierSettings
from surgery.jobs.greedy import FORMS, PATIENCE, Budget, Chosen, Trial, Walk, greedy, walk
from surgery.jobs.trials import Trials
from surgery.measure import statistics
from surgery.measure.statistics import Delta
from surgery.model.blocks import BlockMap
from surgery.model.subject import Subject
from surgery.passes import Fix
from surgery.text.data import Windows

Score = Literal["c_comp", "c_stream", "c"]  # what ranks the candidates: the fixed block's held-out defect, the stream's, the block's
SCORES: tuple[Score, ...] = get_args(Score)


@dataclasses.dataclass(frozen=True)
class SelectionSettings:
    """How `select_layers` chooses: parallelize's Budget options, read once.

    Attributes:
        budget: what the chosen set may cost on the selection windows (mean token KL and dNLL, nats, on point estimates).
        windows: how many selection windows to read, from the corpus's calibration part (`--windows`).
        score: what ranks the candidates: `c_comp` (default with a fit; a block without a fix is ranked by its c_stream), `c_stream`
            (default without) or `c`.
        max_layers: stop when this many blocks are chosen (None: no limit).
        patience: stop after this many candidates in a row miss the budget (None or 0: try them all).
        protect_first: never choose the first this many blocks.
        protect_last: never choose the last this many blocks.
        try_both: try every candidate compensated and plain, and keep the passing form that costs less (Budget.cost); else plain is
            tried only after compensated misses and the fit did not lower the held-out defect.
        refit: fit the chosen compensated blocks' fixes again with every chosen block in place; the refitted fixes are kept if the
            chosen set then costs less on the selection windows.
        frontier: walk on past the budget, one block per point, to its ceiling (surgery.jobs.greedy.walk; FrontierSettings); with
            its `point`, the Selection is that point's set instead of the budget's. None: stop at the budget.
    """

    budget: Budget = Budget()
    windows: int = 16
    score: Score | None = None
    max_layers: int | None = None
    patience: int | None = PATIENCE
    protect_first: int = 0
    protect_last: int = 0
    try_both: bool = False
    refit: bool = False
    frontier: FrontierSettings | None = None

    def __post_init__(self):
        if self.frontier is not None and self.refit:
            raise SurgeryError("--frontier and --refit: the frontier's points share one set of fixes; drop one of them")


@dataclasses.dataclass(frozen=True)
class Selection:
    """What `select_layers` chose, and everything it measured on the way (selection.json's `selection`: `to_json()`).

    Per-layer tuples (c, c_stream, c_comp, alpha) have one entry per block, None where a block is not sequential (c_comp:
    or has no fix). dNLL and KL are in nats, on the selection windows.

    Attributes:
        layers: the chosen blocks, in order.
        forms: layer -> how it is written: `compensated` (with its fix; calibrated for fit `gate`) or `plain`.
        score: what ranked the candidates (`c_comp`, `c_stream` or `c`).
        fit: `full`, `gate`, or None (no compensation).
        c: C_l of each block.
        c_stream: C_l^stream of each block, the uncompensated score.
        c_comp: C_l^comp of each block, the fixed block's held-out defect.
        alpha: alpha_l of each block, the paper's gate.
        fits: layer -> FitResult of each fitted block (the refitted ones when the refit was kept).
        trials: every trial of the greedy, in order: the layer, its form and score, the chosen set's dNLL and KL with it, kept or not.
        base_loss: the original's loss on the selection windows, nats.
        dnll: the chosen set's dNLL vs the original, with its 95 % paired bootstrap interval.
        divergence: the chosen set's KL vs the original (mean, interval, p99, top-1 agreement); None when nothing is chosen.
        refit: what the sequential refit did (layers, dNLL and KL before and after, kept); None when it did not run.
        fit_passes: passes over the fit windows: one per chunk of layers whose normal equations fit in memory (+ the refit's).
        forward_passes: passes over the selection windows: the baseline and one per trial (+ 1 for a refit).
        seconds: wall time of each step: fit (or scores), selection, refit.
        fit_seconds: where the fit's (and refit's) time went: forward, accumulate, solve.
        candidates: how many sequential blocks could be chosen, ranked.
        stopped: why the greedy stopped before the last candidate (--max-layers reached, patience run out); None: it did not.
        fit_memory: the bytes one fit pass's normal equations could take (--fit-memory); None without a fit.
        requantize: how the codes of chosen compensated MatMulNBits blocks were chosen; None when there is none.
        blocks_run: blocks the forward passes ran (a resumed trial runs the blocks from its start on; the rest all).
        budget: the limits the chosen set was held to.
    """

    layers: tuple[int, ...]
    forms: dict[int, Form]  # layer -> how it was written
    score: Score
    fit: Kind | None  # None: no compensation
    c: tuple[float | None, ...]
    c_stream: tuple[float | None, ...]
    c_comp: tuple[float | None, ...]
    alpha: tuple[float | None, ...]
    fits: dict[int, FitResult]
    trials: tuple[Trial, ...]
    base_loss: float  # selection windows
    dnll: Delta  # of the chosen set, selection windows
    divergence: statistics.Divergence | None  # of the chosen set vs the original, selection windows (None: nothing chosen)
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
    budget: Budget = Budget()  # the limits the chosen set was held to
    walk: Walk | None = None  # the frontier's walk past the budget (SelectionSettings.frontier)

    @property
    def uncompensated(self) -> dict[int, str]:
        """Each chosen block written plain although compensation was asked for because its fix could not be
        made (a failed fit, or weights it cannot be folded into) -> why. Plain chosen on measurement is not here."""
        if self.fit is None:
            return {}
        return {l: self.fits[l].note or "no fix" for l in self.layers if self.forms[l] == "plain" and l in self.fits and self.fits[l].fix is None}

    def counts(self) -> dict[str, int]:
        """How many chosen blocks were written in each form."""
        return {f: sum(1 for v in self.forms.values() if v == f) for f in FORMS}

    def describe(self, fused: bool) -> str:
        """What was written, in words: `compensated`, `calibrated`, `plain`, `compensated and plain` (maybe `fused ...`), or `none`."""
        counts = self.counts()
        fixed = {"full": "compensated", "gate": "calibrated", None: "plain"}[self.fit]
        if not self.layers:
            return "none"
        kinds = [k for k, c in ((fixed, counts["compensated"]), ("plain", counts["plain"])) if c]
        return ("fused " if fused else "") + " and ".join(dict.fromkeys(kinds))

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



@dataclasses.dataclass(frozen=True)
class _Refit:
    """What the refit did: its report and fit passes, its trial session, and the fits with the refitted fixes and
    the chosen set's cost with them (kept when report["kept"])."""

    report: dict
    fit_passes: int
    trials: Trials
    fits: dict[int, FitResult]
    dnll: Delta
    divergence: statistics.Divergence
    seconds: dict[str, float]  # where the refit's time went (Fits.seconds)


def select_layers(
    model: ir.Model,
    windows: Windows,
    *,
    fit_windows: Windows | None = None,
    fit: FitSettings | None = FitSettings(),
    settings: SelectionSettings = SelectionSettings(),
    options: runtime.Options = runtime.Options(),
    progress: Tell | None = None,
    pool: cluster.Pool = cluster.Pool(),
    work: Checkpoints | None = None,
) -> Selection:
    """Greedy selection of blocks to parallelize (see the module docstring): the sequential blocks, ranked by a one-pass score
    (lowest first), are added one at a time while the whole chosen set stays within `budget` on the selection windows.

    Args:
        model: the model as exported, or its Subject; not modified.
        windows: the selection windows, where each trial of the chosen set is measured against the original (disjoint from `fit_windows` and the evaluation's).
        fit_windows: where the fixes are fitted (needed when `fit` is set).
        fit: how the fixes are fitted (FitSettings: `full` least-squares fix or `gate`, the paper's alpha_l; memory, requantization,
            input side), or None: no compensation (blocks tried plain, scores from one pass over `windows`).
        settings: how to choose (SelectionSettings: the budget, the score, limits, protected blocks, forms to try, refit).
        options: ONNX Runtime session options.
        progress: called as progress(stage, done, total) while the fit (or the defect scores), the greedy and the refit run.
        pool: where the fit's windows and each trial's batches of selection windows are run (Ray actors, or this process).
        work: where the fit, the trials and the refit keep their finished units and resume from them (surgery.files.checkpoint; None: nothing kept).

    Returns:
        The Selection: the chosen layers and the form of each, every block's scores and fit, every trial, and the chosen set's dNLL and KL.

    Raises:
        SurgeryError: an unknown score, score `c_comp` without a fit, a fit without `fit_windows`, or what
            `compensation.fit` refuses.
    """
    score = _score(settings.score, fit, fit_windows)
    tell, work = progress or silent, work or Checkpoints.off()
    model = Subject.of(model)  # read once: the fit, the trials and the refit take it
    seconds, fit_seconds = {}, {}  # each step's wall time; where the fit's went (forward, accumulate, solve)
    start = time.perf_counter()
    fits, fit_passes, stats = _fit(model, windows, fit_windows, fit, options, pool, tell, work.scope("fit"))
    _add(fit_seconds, getattr(fits, "seconds", {}))
    seconds["fit" if fit else "scores"] = time.perf_counter() - start

    start = time.perf_counter()
    candidates, rank = _candidates(model.blocks, stats, score, settings.protect_first, settings.protect_last)
    runs = Trials(model, fixes_of(fits), windows, candidates, pool, options, work=work.scope("trials"))
    frontier, walked = settings.frontier, None
    point = frontier.point if frontier else None
    most = min(point, settings.max_layers or point) if point else settings.max_layers  # the greedy's part of point `point`
    chosen = greedy(runs, candidates, rank, fits, dataclasses.replace(settings, max_layers=most), tell)
    seconds["selection"] = time.perf_counter() - start
    if frontier is not None and (point is None or point > len(chosen.forms)):
        start = time.perf_counter()
        walked = walk(runs, candidates, rank, fits, chosen, settings, None if point else frontier.max_kl, point or frontier.max_layers, tell)
        seconds["frontier walk"] = time.perf_counter() - start
        chosen = walked.after(chosen) if point else chosen

    again = None
    if settings.refit and "compensated" in chosen.forms.values():
        start = time.perf_counter()
        again = _refit(runs, fit_windows, chosen, fits, settings.budget, fit, tell, work)
        _add(fit_seconds, again.seconds)
        seconds["refit"] = time.perf_counter() - start
    return _selection(model, chosen, stats, fits, runs, again, score=score, fit=fit.kind if fit else None, fit_passes=fit_passes,
                      fit_seconds=fit_seconds, seconds=seconds, candidates=len(candidates), fit_memory=fit.memory if fit else None,
                      requantize=fit.requantize if fit else None, budget=settings.budget, walk=walked)


def _add(clock: dict[str, float], seconds: dict[str, float]) -> None:
    for key, value in seconds.items():
        clock[key] = clock.get(key, 0.0) + value


def ranking(score: Score | None, fit: FitSettings | None) -> Score:
    """The score to rank by (default: c_comp when compensating, else c_stream), once it and the fit agree: what the main
    job checks before any work."""
    score = score or ("c_comp" if fit else "c_stream")
    if score not in SCORES:
        raise SurgeryError(f"unknown score {score!r}; use one of {', '.join(SCORES)}")
    if fit is None and score == "c_comp":
        raise SurgeryError("score c_comp needs compensation; use c_stream or c with --no-compensate")
    return score


def _score(score: Score | None, fit: FitSettings | None, fit_windows: Windows | None) -> Score:
    """`ranking`, once the fit windows are there too."""
    score = ranking(score, fit)
    if fit is not None and fit_windows is None:
        raise SurgeryError("compensation needs fit windows, disjoint from the selection windows")
    return score


def _fit(model: Subject, windows: Windows, fit_windows: Windows | None, fit: FitSettings | None, options: runtime.Options,
         pool: cluster.Pool, tell: Tell, work: Checkpoints) -> tuple[dict[int, FitResult], int, dict[str, list[float | None]]]:
    """Every sequential block's fix, fitted in one pass over the fit windows (none without `fit`), the fit passes made, and
    each score per layer (c, c_stream, alpha, c_comp; None where a block is not sequential or c_comp where it has no fix).
    Without a fit the scores come from one pass over the selection windows."""
    n = len(model.blocks)
    if fit is None:
        stats = defect_scores(model, windows, options, lambda d, t: tell("defect scores", d, t))
        stats["c_comp"] = [None] * n
        return {}, 0, stats
    fit_passes = compensation.fit_passes(model, settings=fit, pool=pool)
    fits = compensation.fit(model, fit_windows, settings=fit, options=options, pool=pool, work=work,
                            progress=lambda d, t: tell(f"fit ({fit_passes} pass{'es' if fit_passes > 1 else ''})", d, t))
    stats = {k: [fits[l].scores[k] if l in fits else None for l in range(n)] for k in ("c", "c_stream", "alpha")}
    stats["c_comp"] = [fits[l].c_comp if l in fits and fits[l].fix is not None else None for l in range(n)]
    return fits, fit_passes, stats


def _candidates(blocks: list[BlockMap], stats: dict[str, list[float | None]], score: Score, protect_first: int,
                protect_last: int) -> tuple[list[int], list[float | None]]:
    """The sequential blocks that may be chosen, lowest score first, and the score each block is ranked by."""
    n = len(blocks)
    # A block without a fix (a failed fit, or weights it cannot be folded into) can only be written plain: its plain score ranks it.
    rank = [stats[score][l] if stats[score][l] is not None or score != "c_comp" else stats["c_stream"][l] for l in range(n)]
    candidates = [
        b.layer for b in blocks
        if not b.is_parallel and protect_first <= b.layer < n - protect_last and rank[b.layer] is not None
    ]
    candidates.sort(key=lambda layer: rank[layer])
    return candidates, rank


def _refit(runs: Trials, fit_windows: Windows, chosen: Chosen, fits: dict[int, FitResult], budget: Budget, fit: FitSettings,
           tell: Tell, work: Checkpoints) -> _Refit:
    """The chosen compensated blocks' fixes fitted again with every chosen block in place, and the chosen set's cost
    with them on the selection windows (the baseline run of `runs` reused); kept if that costs less."""
    model, pool, options = runs.subject, runs.pool, runs.options
    compensated = {l for l, f in chosen.forms.items() if f == "compensated"}
    fixes = fixes_of(fits)
    fit_passes = compensation.fit_passes(model, compensated, fit, pool, compensated=compensated)  # they keep their input sides
    again = compensation.fit(model, fit_windows, compensated, settings=fit, fixes=fixes, forms=chosen.forms, options=options, pool=pool,
                             work=work.scope("refit"), progress=lambda d, t: tell("refit", d, t))
    new_fits = {**fits, **{l: f for l, f in again.items() if f.fix is not None}}
    new_fixes = fixes_of(new_fits)
    refitted = Trials(model, new_fixes, runs.windows, [], pool, options, baseline=runs, work=work.scope("refit-trials"))
    d, kl, _ = refitted.loss(chosen.forms)
    kept = budget.cost(d.dnll, kl.kl) < budget.cost(chosen.dnll.dnll, chosen.divergence.kl)
    report = {"layers": sorted(again), "dnll_before": chosen.dnll.to_json(), "dnll_after": d.to_json(),
              "kl_before": chosen.divergence.to_json(), "kl_after": kl.to_json(), "kept": kept}
    return _Refit(report, fit_passes, refitted, new_fits, d, kl, again.seconds)


def _selection(model: ir.Model, chosen: Chosen, stats: dict[str, list[float | None]], fits: dict[int, FitResult], runs: Trials,
               again: _Refit | None, *, fit_passes: int, requantize: str | None, **fields) -> Selection:
    """The Selection of the greedy's chosen set, with the refit's fixes and cost when it kept them; `fields`: the rest as they are."""
    dnll, divergence = chosen.dnll, chosen.divergence
    if again is not None and again.report["kept"]:
        fits, dnll, divergence = again.fits, again.dnll, again.divergence
    compensated = {l for l, f in chosen.forms.items() if f == "compensated"}
    return Selection(
        layers=tuple(sorted(chosen.forms)),
        forms=dict(sorted(chosen.forms.items())),
        c=tuple(stats["c"]),
        c_stream=tuple(stats["c_stream"]),
        c_comp=tuple(stats["c_comp"]),
        alpha=tuple(stats["alpha"]),
        fits=fits,
        trials=chosen.trials,
        base_loss=runs.base.loss,
        dnll=dnll,
        divergence=divergence,
        refit=None if again is None else again.report,
        fit_passes=fit_passes + (again.fit_passes if again else 0),
        forward_passes=runs.passes + (again.trials.passes if again else 0),
        blocks_run=runs.blocks_run + (again.trials.blocks_run if again else 0),
        stopped=chosen.stopped,
        requantize=requantize if set(requantization.quantized_outputs(model)) & compensated else None,
        **fields,
    )
