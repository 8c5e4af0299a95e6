"""The greedy that chooses blocks for --layers auto, and the frontier's walk past its budget.

The greedy (`greedy`) adds the ranked candidates one at a time, each in the first form whose trial of the whole chosen
set stays within the Budget on the selection windows (surgery.jobs.select runs it). Its kept trials are the first
points of the frontier: point k is the chosen set after its k-th block.

The walk (`walk`, `--frontier`) goes on from the greedy's set past the budget, one block per point, to a ceiling: each
step adds the remaining candidate whose trial costs least on top of the set so far (Budget.cost: KL when limited). It
is lazy: a candidate's cost on top of an earlier set (a missed trial of the greedy, or of an earlier step) stands for
its cost now until it is the cheapest, then it is measured again, and kept when it still costs no more than every
other's standing cost; so a step usually costs one or two trials, not one per candidate. A candidate the greedy never
tried (it stopped first: they rank after the tried ones) stands at the highest cost the greedy saw. Where adding blocks
only makes the others cost more (the usual case), and an untried candidate costs no less than the tried ones, this is
the same choice as trying every candidate at every step. Points 1..k of a frontier whose greedy chose k blocks are the greedy's: the main job's
set is on the frontier.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, get_args

from surgery.analysis.fit_graph import Form
from surgery.compensation.equations import FitResult
from surgery.engine.progress import Tell
from surgery.errors import SurgeryError
from surgery.jobs.trials import Trials
from surgery.measure import statistics
from surgery.measure.statistics import Delta

if TYPE_CHECKING:
    from surgery.jobs.select import SelectionSettings

FORMS: tuple[Form, ...] = get_args(Form)
PATIENCE = 6  # auto stops after this many candidates in a row miss the budget


@dataclasses.dataclass(frozen=True)
class Trial:
    layer: int
    form: Form
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
    (nats) and dNLL (nats); None switches a limit off. Both must hold.

    Attributes:
        max_kl: the most mean token KL(original || chosen set) allowed, nats (`--max-kl`); None: no limit.
        max_loss_increase: the most dNLL (loss of the chosen set minus the original's) allowed, nats
            (`--max-loss-increase`); None: no limit.

    Raises:
        SurgeryError: a limit that is not a positive finite number (or None).
    """

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

    def holds(self, d: Delta, kl: statistics.Divergence) -> bool:
        return (self.max_kl is None or kl.kl <= self.max_kl) and (self.max_loss_increase is None or d.dnll <= self.max_loss_increase)

    def cost(self, dnll: float, kl: float) -> float:
        """What "better" means between passing forms, fixes or frontier points: KL when it is limited, else dNLL."""
        return kl if self.max_kl is not None or self.max_loss_increase is None else dnll


@dataclasses.dataclass(frozen=True)
class Chosen:
    """Where the greedy left the chosen set: its forms, every trial, its cost on the selection windows, why it stopped."""

    forms: dict[int, Form]
    trials: tuple[Trial, ...]
    dnll: Delta
    divergence: statistics.Divergence | None  # None: nothing chosen
    stopped: str | None


def greedy(runs: Trials, candidates: list[int], rank: list[float | None], fits: dict[int, FitResult], settings: "SelectionSettings",
            tell: Tell) -> Chosen:
    """Add the candidates in order, each in the first form to try (try_both: the cheapest form) whose trial of the whole
    chosen set stays within the budget; stop at max_layers, or after `patience` misses in a row."""
    budget, max_layers, patience, try_both = settings.budget, settings.max_layers, settings.patience, settings.try_both
    chosen: dict[int, Form] = {}
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
        for form in forms_to_try(layer, fits, try_both):
            d, kl, run = runs.loss({**chosen, layer: form}, new=layer)
            trials.append(Trial(layer, form, float(rank[layer]), d.dnll, d.low, d.high, False, kl.kl, kl.low, kl.high, kl.top1))
            if budget.holds(d, kl):
                passing.append((budget.cost(d.dnll, kl.kl), form, d, kl, len(trials) - 1, run))
                if not try_both:
                    break
        misses = 0 if passing else misses + 1
        if passing:
            _, form, current, current_kl, index, run = min(passing, key=lambda p: p[0])
            chosen[layer] = form
            runs.accept(run)
            trials[index] = dataclasses.replace(trials[index], kept=True)
        tell("greedy selection", i + 1, len(candidates))
    if stopped:
        tell("greedy selection", len(candidates), len(candidates))  # the rest are not tried: the stage is done
    return Chosen(chosen, tuple(trials), current, current_kl, stopped)


def forms_to_try(layer: int, fits: dict[int, FitResult], try_both: bool) -> tuple[Form, ...]:
    """The forms to try for a candidate, in order. Compensated first when it has a fix; plain after
    it only with try_both, or when the fit does not lower the held-out defect (a bad fit)."""
    f = fits.get(layer)
    if f is None or f.fix is None:
        return ("plain",)
    return ("compensated", "plain") if try_both or f.residual is None or f.residual >= 1.0 else ("compensated",)


@dataclasses.dataclass(frozen=True)
class Walk:
    """The frontier's path past the budget: every trial the walk ran (its kept ones are the points after the greedy's),
    and why it stopped."""

    trials: tuple[Trial, ...]
    stopped: str
    dnll: Delta | None = None  # the last point's, selection windows (None: no point past the greedy's)
    divergence: statistics.Divergence | None = None

    @property
    def points(self) -> tuple[Trial, ...]:
        return tuple(t for t in self.trials if t.kept)

    def after(self, chosen: Chosen) -> Chosen:
        """The greedy's Chosen extended by the walk's points: the last point's set, and its cost."""
        if not self.points:
            return chosen
        forms = {**chosen.forms, **{t.layer: t.form for t in self.points}}
        return Chosen(forms, chosen.trials + self.trials, self.dnll, self.divergence, self.stopped)


def walk(runs: Trials, candidates: list[int], rank: list[float | None], fits: dict[int, FitResult], chosen: Chosen, settings: "SelectionSettings",
         ceiling: float | None, most: int | None, tell: Tell) -> Walk:
    """Past the greedy's chosen set, one block per point, lazily (module docstring), until the next point's KL on the
    selection windows would pass `ceiling`, `most` blocks are chosen, or no candidate is left. `runs`' accepted set is
    the greedy's; the walk's points become it in turn."""
    budget, try_both = settings.budget, settings.try_both
    cost = lambda t: budget.cost(t.dnll, t.kl)  # noqa: E731
    forms, level, version = dict(chosen.forms), 0.0, 0  # the set, its cost, how many blocks it has had
    standing: dict[int, tuple[float, int]] = {}  # candidate -> (its cost on top of the set it was tried with, that set's version)
    for t in chosen.trials:
        if t.kept:
            level, version = cost(t), version + 1
            standing.pop(t.layer, None)
        elif t.layer not in standing or cost(t) - level < standing[t.layer][0]:
            standing[t.layer] = (cost(t) - level, -1)  # measured again before it is kept: its run is gone
    order = {layer: i for i, layer in enumerate(candidates)}
    if standing:  # a candidate the greedy never tried ranks after every tried one: it stands at their highest cost until measured
        highest = max(c for c, _ in standing.values())
        standing |= {l: (highest, -1) for l in candidates if l not in forms and l not in standing}
    trials: list[Trial] = []
    best: tuple[int, dict, Delta, statistics.Divergence] | None = None  # the cheapest trial on top of the current set: its index, run, cost
    last = (None, None)  # the last point's dNLL and KL
    while True:
        left = [l for l in candidates if l not in forms]
        if most is not None and len(forms) >= most:
            stopped = f"--frontier-max-layers {most} reached"
            break
        if not left:
            stopped = "every candidate is chosen"
            break
        layer = min(left, key=lambda l: (l in standing, standing.get(l, (0.0,))[0], order[l]))  # never tried at all first, in rank order
        if standing.get(layer, (0.0, -1))[1] != version:  # its cost is of an older set: measure it on top of this one
            for form in forms_to_try(layer, fits, try_both):
                d, kl, run = runs.loss({**forms, layer: form}, new=layer)
                trials.append(Trial(layer, form, float(rank[layer]), d.dnll, d.low, d.high, False, kl.kl, kl.low, kl.high, kl.top1))
                if best is None or cost(trials[-1]) < cost(trials[best[0]]):
                    best = (len(trials) - 1, run, d, kl)
                if layer not in standing or standing[layer][1] != version or cost(trials[-1]) - level < standing[layer][0]:
                    standing[layer] = (cost(trials[-1]) - level, version)
            continue
        index, run, *numbers = best  # the cheapest candidate, measured on top of this very set
        t = trials[index]
        if ceiling is not None and t.kl > ceiling:
            stopped = f"the next point (block {t.layer}) costs KL {t.kl:.4f} > --frontier-max-kl {ceiling:g}"
            break
        trials[index] = dataclasses.replace(t, kept=True)
        runs.accept(run)
        forms[t.layer], level, version, best, last = t.form, cost(t), version + 1, None, numbers
        standing.pop(t.layer)
        if len(forms) < (most or len(candidates)):
            tell("frontier walk", len(forms), most or len(candidates))
    tell("frontier walk", most or len(candidates), most or len(candidates))  # the stage is done, however the walk stopped
    return Walk(tuple(trials), stopped, *last)

