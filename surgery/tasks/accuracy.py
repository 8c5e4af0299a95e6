"""Accuracy on downstream tasks (tasks.py) of one or more graphs on ONNX Runtime, the first the baseline.

Each model scores each task's documents (likelihood.py); per document it is right or wrong under acc and acc_norm
(lm-eval's metrics). Against the first model: the difference of accuracies with a paired 95 % bootstrap interval over
documents (the same documents resampled for both), and "accuracy kept": the mean over tasks of this model's headline
accuracy (acc_norm where lm-eval has it, acc otherwise; sciq acc) over the first's, its interval from resampling each
task's documents. Never prints.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from surgery.engine import runtime
from surgery.engine.progress import Step, Tell, counter, silent
from surgery.files.checkpoint import Checkpoints
from surgery.tasks.catalog import Item, Task, arrow_file, items, parse
from surgery.tasks.likelihood import Likelihood, check_like

RESAMPLES = 2000
DOCUMENTS = 128  # documents scored in one call, whose runs batch together (likelihood.py)


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """Which downstream tasks `surgery evaluate --tasks` and the main job's `--tasks` score: comma-separated names of
    catalog.TASKS (`default`: catalog.DEFAULT, `all`); limit: the first N documents of each (None: all); like: score as
    lm-eval's `hf` backend does (BOS first: the default) or as its `onnxruntime` and `onnxruntime-genai` backends do (no
    BOS), `--like` (likelihood.Likelihood)."""

    tasks: str = "default"
    limit: int | None = None
    like: str = "hf"

    def chosen(self) -> tuple[Task, ...]:
        return parse(self.tasks)

    def check(self) -> None:
        """Refuse unknown task names, an unknown `like` and missing task data (SurgeryError), before any model loads."""
        check_like(self.like)
        for task in self.chosen():
            arrow_file(task)


@dataclasses.dataclass(frozen=True)
class Scores:
    """One model on one task: the log-likelihood of every choice of every document."""

    task: Task
    loglikelihoods: tuple[np.ndarray, ...]  # one [choices] array per document
    gold: np.ndarray
    lengths: tuple[np.ndarray, ...]  # characters of each choice (acc_norm)
    seconds: float

    def correct(self, metric: str) -> np.ndarray:
        """Per document, whether `metric` (acc or acc_norm) picks the gold choice; the first of tied scores wins, as np.argmax."""
        if metric == "acc":
            picks = [int(np.argmax(ll)) for ll in self.loglikelihoods]
        else:
            picks = [int(np.argmax(ll / n)) for ll, n in zip(self.loglikelihoods, self.lengths)]
        return np.array(picks) == self.gold

    def accuracy(self, metric: str) -> float:
        return float(self.correct(metric).mean())


def score(likelihood: Likelihood, task: Task, documents: Sequence[Item], progress: Step | None = None) -> Scores:
    """`task`'s documents under one model, DOCUMENTS at a time; progress(n) after n more documents."""
    start = time.perf_counter()
    lls = []
    for lo in range(0, len(documents), DOCUMENTS):
        chunk = documents[lo : lo + DOCUMENTS]
        got = iter(likelihood([pair for item in chunk for pair in item.pairs]))
        lls += [np.array([next(got)[0] for _ in item.pairs]) for item in chunk]
        if progress:
            progress(len(chunk))
    return Scores(task, tuple(lls), np.array([item.gold for item in documents]),
                  tuple(np.array([float(len(c)) for c in item.choices]) for item in documents), time.perf_counter() - start)


def paired(first: np.ndarray, other: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """Mean of other - first (per-document 0/1) and its paired 95 % bootstrap interval."""
    diff = other.astype(np.float64) - first.astype(np.float64)
    picks = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))
    low, high = np.percentile(diff[picks].mean(1), [2.5, 97.5])
    return float(diff.mean()), float(low), float(high)


def kept(first: Sequence[np.ndarray], other: Sequence[np.ndarray], resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """Mean over tasks of other's accuracy / of first's (per-document 0/1 arrays, one pair per task), and a 95 % bootstrap
    interval: each task's documents resampled, the same for both models (resamples where the first is right on none
    left out)."""
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    with np.errstate(divide="ignore", invalid="ignore"):  # a first model right on no document: no ratio
        point = float(np.mean([o.mean() for o in other]) / np.mean([f.mean() for f in first]))
        for r in range(resamples):
            picks = [rng.integers(0, len(f), len(f)) for f in first]
            ratios[r] = np.mean([o[p].mean() for o, p in zip(other, picks)]) / np.mean([f[p].mean() for f, p in zip(first, picks)])
    ratios = ratios[np.isfinite(ratios)]
    low, high = np.percentile(ratios, [2.5, 97.5]) if len(ratios) else (np.nan, np.nan)
    return point, float(low), float(high)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Every model's Scores on every task (scores[model][task index]), with the models' names; like: the lm-eval backend
    whose tokenization they followed (TaskSettings.like)."""

    names: tuple[str, ...]
    scores: tuple[tuple[Scores, ...], ...]
    like: str = "hf"

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(s.task for s in self.scores[0])

    def headline(self, model: int) -> dict[str, float]:
        """Model `model`'s (index) headline accuracy on each task, by task name."""
        return {s.task.name: s.accuracy(s.task.headline) for s in self.scores[model]}

    def average(self, model: int) -> float:
        """The mean over tasks of model `model`'s headline accuracy (what `kept` divides)."""
        return float(np.mean(list(self.headline(model).values())))

    def kept(self, model: int) -> tuple[float, float, float]:
        """Accuracy kept by model `model` (index) against the first, with its interval."""
        return kept([s.correct(s.task.headline) for s in self.scores[0]], [s.correct(s.task.headline) for s in self.scores[model]])

    def to_json(self) -> dict:
        tasks = {}
        for t, task in enumerate(self.tasks):
            base = self.scores[0][t]
            models = []
            for name, scores in zip(self.names, self.scores):
                own = scores[t]
                entry = {"name": name, "seconds": round(own.seconds, 2), "documents_per_second": round(len(own.gold) / max(own.seconds, 1e-9), 2)}
                entry |= {metric: own.accuracy(metric) for metric in task.metrics}
                if own is not base:
                    entry["vs_first"] = {metric: dict(zip(("difference", "low", "high"), paired(base.correct(metric), own.correct(metric))))
                                         for metric in task.metrics}
                models.append(entry)
            tasks[task.name] = {"documents": len(base.gold), "headline": task.headline, "models": models}
        average = [self.average(m) for m in range(len(self.names))]
        kept_rows = [dict(zip(("name", "kept", "low", "high"), (name, *self.kept(m)))) for m, name in enumerate(self.names) if m]
        return {"tasks": tasks, "average": dict(zip(self.names, average)), "kept": kept_rows, "like": self.like}


def task_accuracy(models: Sequence[str | Path | ir.Model], names: Sequence[str], settings: TaskSettings, options: runtime.Options = runtime.Options(),
                  progress: Tell | None = None, folder: str | Path | None = None) -> Comparison:
    """Every model on every task of `settings`, one model's session at a time; progress(stage, done, total) one stage per
    model and task. folder: the tokenizer's and config's (Likelihood), needed for models in memory."""
    tell = progress or silent
    chosen = settings.chosen()
    documents = [items(task, settings.limit) for task in chosen]  # read (and checked) before any model loads
    scores = []
    for model, name in zip(models, names):
        likelihood = Likelihood(model, options, folder, settings.like)
        scores.append(tuple(score(likelihood, task, docs, counter(tell, f"{task.name} {name}", len(docs)))
                            for task, docs in zip(chosen, documents)))
        del likelihood
    return Comparison(tuple(names), tuple(scores), settings.like)


class ScoreBook:
    """Each model's Scores on `settings`' tasks, scored once by name: kept in memory and, with `work`, as a checkpoint
    unit per model (a resumed run reads them back). The main job's original and rewritten model, and every measured
    point of a frontier, take their scores from one book."""

    def __init__(self, settings: TaskSettings, options: runtime.Options = runtime.Options(), progress: Tell | None = None,
                 folder: str | Path | None = None, work: Checkpoints | None = None):
        self.settings, self.options, self.tell, self.folder = settings, options, progress or silent, folder
        self.work = work or Checkpoints.off()
        self.unit = "+".join(task.name for task in settings.chosen()) + f"-{settings.limit or 'all'}-{settings.like}"
        self.book: dict[str, tuple[Scores, ...]] = {}

    def scores(self, model: str | Path | ir.Model, name: str) -> tuple[Scores, ...]:
        """`model`'s Scores on every task, scored now or read back (from this book, or from the work folder)."""
        if name not in self.book:
            unit = f"{self.unit}/{name}"
            saved = self.work.load(unit)
            if saved is None:
                scored = task_accuracy([model], [name], self.settings, self.options, self.tell, self.folder).scores[0]
                self.work.save(unit, {s.task.name: {"ll": s.loglikelihoods, "gold": s.gold, "lengths": s.lengths, "seconds": s.seconds}
                                      for s in scored})
            else:
                scored = tuple(Scores(task, tuple(saved[task.name]["ll"]), saved[task.name]["gold"], tuple(saved[task.name]["lengths"]),
                                      saved[task.name]["seconds"]) for task in self.settings.chosen())
            self.book[name] = scored
        return self.book[name]

    def compare(self, names: Sequence[str]) -> Comparison:
        """The Comparison of models already scored, the first the baseline."""
        return Comparison(tuple(names), tuple(self.book[n] for n in names), self.settings.like)
