"""The frontier (`surgery parallelize --frontier`): every point of the trade-off in one run.

Point k is the chosen set after its k-th block: the greedy's points up to the budget, the walk's past it, to a ceiling
(surgery.jobs.greedy). Each point is measured as the main job measures its one: KL, top-1 and dNLL with 95 % intervals
on the held-out evaluation windows (one switchboard session, in which point k starts from point k - 1's stream at its
new block: surgery.jobs.trials), the paper's speed estimate, and at every n-th point (and the budget's) the task
accuracy kept (`--tasks`) and the measured latency ratio (`--frontier-latency`). Each point's numbers are a checkpoint
unit; the record is frontier.json (Frontier.to_json; docs/frontier.md has its schema) and frontier.png. The run keeps
its work folder, from which `--frontier-point K` writes any point's graph later without a new fit or selection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from surgery.analysis.fit_graph import Form
from surgery.compensation.equations import fixes as fixes_of
from surgery.engine import cluster, runtime
from surgery.engine.progress import Tell
from surgery.errors import SurgeryError
from surgery.files.checkpoint import Checkpoints
from surgery.jobs.greedy import Trial
from surgery.jobs.trials import Trials
from surgery.measure import statistics
from surgery.measure.statistics import Delta
from surgery.measure.timing import BranchTimes
from surgery.model.subject import Subject
from surgery.tasks.accuracy import ScoreBook
from surgery.text.data import Windows

REACHED = "reached"  # the work folder's unit that says how many points a frontier run reached


@dataclasses.dataclass(frozen=True)
class FrontierSettings:
    """`--frontier` and its options.

    Attributes:
        max_kl: the ceiling: the walk stops before a point whose KL on the selection windows would pass it (nats; None: none).
        max_layers: the walk stops at this many blocks (None: when no candidate is left).
        every: the task accuracy (with --tasks) and the latency (with `latency`) are measured at every n-th point and the budget's.
        latency: time the original and each such point's graph, interleaved (prefill and decode ratios; not kept in checkpoints).
        point: write this point's graph instead of the budget's (`--frontier-point`), read from the frontier run `of`.
        of: the output of the frontier run whose work folder `point` reads (`--frontier-of`).
    """

    max_kl: float | None = 0.5
    max_layers: int | None = None
    every: int = 4
    latency: bool = False
    point: int | None = None
    of: Path | None = None

    def __post_init__(self):
        if self.max_kl is not None and not self.max_kl > 0:
            raise SurgeryError(f"--frontier-max-kl {self.max_kl}: give a positive number of nats, or `none`")
        if (self.point is None) != (self.of is None):
            raise SurgeryError("--frontier-point K goes with --frontier-of OUT (the output of the --frontier run to read the point from)")

    def measured(self, k: int, budget_point: int) -> bool:
        """Whether point k gets the task accuracy and the latency."""
        return k % self.every == 0 or k == budget_point


def ceiling(text: str) -> float | None:
    """--frontier-max-kl: a positive number of nats, or `none`."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise SurgeryError(f"cannot read --frontier-max-kl {text!r}: give a positive number of nats, or `none`") from None


@dataclasses.dataclass(frozen=True)
class Point:
    """Point k of the frontier: its blocks and their forms, its cost on the selection windows (the trial that added
    its last block), on the held-out windows, its speed, and its task accuracy where measured."""

    k: int
    forms: dict[int, Form]
    selection: Trial  # the trial that added block `selection.layer`: the set's dNLL, KL, top-1 on the selection windows
    dnll: Delta  # held out
    divergence: statistics.Divergence  # held out
    estimate: float  # the paper's speed estimate
    latency: dict | None = None  # {"prefill": ratio, "decode": ratio}, original / this point
    tasks: dict | None = None  # {"kept": [kept, low, high], "average": ..., "accuracy": {task: headline accuracy}}

    def to_json(self) -> dict:
        t = self.selection
        return {
            "k": self.k, "layer": t.layer, "form": t.form, "layers": sorted(self.forms), "forms": {str(l): f for l, f in sorted(self.forms.items())},
            "selection": {"kl": t.kl, "kl_interval": [t.kl_low, t.kl_high], "dnll": t.dnll, "dnll_interval": [t.low, t.high], "top1_agreement": t.top1},
            "evaluation": {"kl": self.divergence.kl, "kl_interval": [self.divergence.low, self.divergence.high], "kl_p99": self.divergence.p99,
                           "dnll": self.dnll.dnll, "dnll_interval": [self.dnll.low, self.dnll.high], "top1_agreement": self.divergence.top1},
            "speedup_estimate": self.estimate, "speedup_measured": self.latency, "tasks": self.tasks,
        }


@dataclasses.dataclass(frozen=True)
class Frontier:
    """Every point of one frontier run, and what bounds it (frontier.json: to_json)."""

    points: tuple[Point, ...]
    budget_point: int  # k of the main job's set (the budget's)
    budget: dict  # the main job's limits
    ceiling: dict  # --frontier-max-kl, --frontier-max-layers
    stopped: str  # why the walk stopped
    walk: tuple[Trial, ...]  # every trial past the budget, in order (kept: a point)
    base_loss: float  # the original's, held-out text windows
    eval_tokens: int
    tasks: dict | None  # the tasks, documents each, and the original's accuracies; None without --tasks

    def to_json(self) -> dict:
        return {"format": 1, "budget_point": self.budget_point, "budget": self.budget, "ceiling": self.ceiling, "stopped": self.stopped,
                "base_loss_eval": self.base_loss, "eval_tokens": self.eval_tokens, "tasks": self.tasks,
                "points": [p.to_json() for p in self.points], "walk": [dataclasses.asdict(t) for t in self.walk]}


@dataclasses.dataclass(frozen=True)
class Measures:
    """What measures each point besides the held-out windows: the branch times (the speed estimate), and for the
    measured points a graph builder, the task scores and the latency ratios."""

    subject: Subject  # the original
    times: BranchTimes
    graph: Callable[[dict[int, Form]], ir.Model]  # the rewritten model of a set of blocks and forms
    book: ScoreBook | None = None  # --tasks
    latency: Callable[[ir.Model], dict] | None = None  # --frontier-latency: original / this graph, {"prefill": x, "decode": y}


def path(selection) -> tuple[Trial, ...]:
    """The frontier's points in order: the greedy's kept trials, then the walk's."""
    walked = selection.walk.points if selection.walk is not None else ()
    return tuple(t for t in selection.trials if t.kept) + walked


def measure(selection, windows: Windows, settings: FrontierSettings, measures: Measures, *, pool: cluster.Pool,
            options: runtime.Options, tell: Tell, work: Checkpoints) -> Frontier:
    """Every point of the selection's path (`path`) on the held-out `windows`, with its speed estimate, and at the measured
    points its task accuracy and latency. `selection`: select_layers' Selection, with its walk."""
    steps = path(selection)
    budget_point = len(selection.layers)
    runs = Trials(measures.subject, fixes_of(selection.fits), windows, sorted({t.layer for t in steps}), pool, options,
                  work=work.scope("frontier"))
    if measures.book:
        measures.book.scores(measures.subject.model, "original")
    points, forms = [], {}
    for k, step in enumerate(steps, 1):
        forms = {**forms, step.layer: step.form}
        d, kl, run = runs.loss(forms, new=step.layer)
        runs.accept(run)
        latency = tasks = None
        if settings.measured(k, budget_point) and (measures.book or measures.latency):
            rewritten = measures.graph(forms)
            if measures.book:
                measures.book.scores(rewritten, f"point-{k}")
                tasks = _tasks(measures.book.compare(["original", f"point-{k}"]))
            if measures.latency:
                latency = measures.latency(rewritten)
        points.append(Point(k, dict(sorted(forms.items())), step, d, kl, measures.times.estimated_speedup(forms), latency, tasks))
        tell("frontier points", k, len(steps))
    work.save(f"frontier/{REACHED}", {"points": len(points)})
    walk = selection.walk
    task_info = None
    if measures.book:
        original = measures.book.compare(["original"])
        task_info = {"names": [t.name for t in original.tasks], "documents": {s.task.name: len(s.gold) for s in original.scores[0]},
                     "like": original.like, "original": original.headline(0)}
    return Frontier(tuple(points), budget_point, dataclasses.asdict(selection.budget), {"max_kl": settings.max_kl, "max_layers": settings.max_layers},
                    walk.stopped if walk else "", walk.trials if walk else (), runs.base.loss, windows.tokens, task_info)


def _tasks(compared) -> dict:
    """A point's task accuracy against the original's: the accuracy kept with its interval, the mean, and each task's."""
    return {"kept": list(compared.kept(1)), "average": compared.average(1), "accuracy": compared.headline(1)}


def reached(of: Path, work: Checkpoints) -> int:
    """How many points the frontier run whose work folder is `work` reached (SurgeryError: it never finished one)."""
    done = work.scope("frontier").load(REACHED)
    if done is None:
        raise SurgeryError(f"the work folder of {of} holds no finished frontier; run `surgery parallelize ... -o {of} --frontier` to its end first")
    return int(done["points"])
