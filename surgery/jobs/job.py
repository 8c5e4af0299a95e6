"""The main job of `surgery parallelize`: auto (load, fit, select, rewrite, evaluate, time, write) and its Outcome,
and what explicit --layers runs: fit_fixes and parallel_form."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import onnx_ir as ir

from surgery import compensation
from surgery.compensation.fitting import FitSettings
from surgery.engine import runtime
from surgery.engine.cluster import Resources
from surgery.engine.progress import Tell, counter, silent
from surgery.errors import SurgeryError
from surgery.files import checkpoint, graph
from surgery.files.checkpoint import Checkpoints, digest, model_digest
from surgery.jobs import frontier as measured_frontier
from surgery.jobs import select
from surgery.jobs.picture import frontier_picture, selection_picture
from surgery.jobs.select import Selection, SelectionSettings, select_layers
from surgery.measure import scoring, statistics, timing
from surgery.measure.statistics import Delta
from surgery.measure.timing import LatencySettings
from surgery.model.blocks import BlockMap
from surgery.model.subject import Subject
from surgery.passes import Fix, compensate, fuse, parallelize
from surgery.passes.fuse import refusal as fuse_refusal
from surgery.tasks import accuracy
from surgery.tasks.accuracy import TaskSettings
from surgery.text import data
from surgery.text.data import DataSettings


def fit_fixes(subject: Subject, layers, fit: FitSettings, source: DataSettings, options: runtime.Options = runtime.Options()) -> dict[int, Fix]:
    """The fixes of the given sequential blocks, fitted in one pass over `fit.windows` calibration windows of `source`
    (explicit --layers). A block whose fit fails is an error: compensation was asked for, so it is never silently written plain."""
    windows = source.windows(subject, fit.windows, "calibration")
    fits = compensation.fit(subject, windows, set(layers), settings=fit, options=options)
    for layer, f in sorted(fits.items()):
        if f.fix is None:
            raise SurgeryError(f"cannot compensate block {layer}: {f.note}; or parallelize it plain with --no-compensate")
    return {l: f.fix for l, f in fits.items()}


def parallel_form(model: "ir.Model | Subject", layers, *, fused: bool = False, fixes: dict[int, Fix] | None = None):
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
class JobSettings:
    """Everything the main job is told, grouped as parallelize's option panels and handed down whole.

    Attributes:
        data: where the windows come from (`--data`, `--seq-len`, `--tokenizer`).
        fit: how the fixes are fitted, `--fit-windows` of them (FitSettings), or None: no compensation (`--no-compensate`).
        selection: how the blocks are chosen, on `--windows` selection windows (SelectionSettings: the budget and the greedy's limits).
        eval_windows: evaluation windows, from the corpus's evaluation part (disjoint from both): the reported dNLL and KL are on them.
        fused: write the chosen blocks in the fused parallel form (`fuse`) instead of plain or compensated parallel blocks.
        latency: time the prefill and decode of the original and the rewritten model, interleaved (LatencySettings).
        resources: session options, and the Ray cluster (`--workers`, `--ray`) that runs the fit pass and the trials.
        checkpoints: keep the finished units (the fit's, each trial's, the evaluation's) in the work folder `OUT.work` beside the
            output, and resume from it when it holds an interrupted run of the same model, windows and options (surgery.files.checkpoint);
            a finished run removes it.
        restart: discard that work folder first instead of resuming from it.
        tasks: also score the original and the rewritten model on downstream tasks (`--tasks`, TaskSettings; task documents
            are never calibration data), reported as each task's accuracies, their paired intervals and the accuracy kept.
    """

    data: DataSettings = DataSettings()
    fit: FitSettings | None = FitSettings()
    selection: SelectionSettings = SelectionSettings()
    eval_windows: int = 32
    fused: bool = False
    latency: LatencySettings = LatencySettings()
    resources: Resources = Resources()
    checkpoints: bool = True
    restart: bool = False
    tasks: TaskSettings | None = None

    def results(self) -> dict:
        """The settings that change results, by name (what a work folder is tied to, and what its refusal names): not those
        that change only speed or memory, nor the window counts (the windows' own digests stand for them)."""
        fit = {} if self.fit is None else {k: v for k, v in dataclasses.asdict(self.fit).items() if k not in ("kind", "memory", "windows")}
        greedy = {k: v for k, v in dataclasses.asdict(self.selection).items() if k not in ("windows", "frontier")}
        return {**fit, "fit": None if self.fit is None else self.fit.kind, "fused": self.fused, **greedy, "budget": self.selection.budget}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `surgery parallelize --layers auto` reports and writes to selection.json."""

    selection: Selection
    form: str  # "plain", "compensated", "calibrated", each maybe "fused ..."
    base_loss_eval: float
    dnll_eval: Delta  # held-out evaluation windows, 95 % paired bootstrap interval
    eval_tokens: int
    divergence_eval: statistics.Divergence  # KL vs the original, p99, top-1 agreement, llama.cpp's statistics on the evaluation windows
    estimated_speedup: float  # the paper's max(t_attn, t_mlp) estimate, from per-branch kernel times
    prefill_ratio: float | None  # original / rewritten, one interleaved run
    decode_ratio: float | None
    latency: dict | None
    windows: dict  # fit / selection / evaluation: count, tokens, and how many windows are the model's own samples
    estimate_placement: str | None = None  # where the estimate's kernels were profiled: the latency's device
    resumed: dict[str, int] = dataclasses.field(default_factory=dict)  # finished units read back from the work folder, by step
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time of the steps after the selection: evaluation
    checkpoints: dict = dataclasses.field(default_factory=dict)  # what writing the work folder's units cost: seconds, bytes, units
    tasks: dict | None = None  # with --tasks: accuracy.Comparison.to_json() of the original and the rewritten model
    frontier: dict | None = None  # with --frontier: frontier.json (Frontier.to_json)

    @property
    def over_budget(self) -> dict[str, dict[str, float]]:
        """The limits the chosen set meets on the selection windows (where the budget is held, on point estimates) but
        not on the held-out evaluation windows: `kl` and / or `dnll` -> the held-out value and the limit."""
        budget, over = self.selection.budget, {}
        if budget.max_kl is not None and self.selection.layers and self.divergence_eval.kl > budget.max_kl:
            over["kl"] = {"evaluation": self.divergence_eval.kl, "limit": budget.max_kl}
        if budget.max_loss_increase is not None and self.selection.layers and self.dnll_eval.dnll > budget.max_loss_increase:
            over["dnll"] = {"evaluation": self.dnll_eval.dnll, "limit": budget.max_loss_increase}
        return over

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["over_budget"] = self.over_budget
        data["selection"] = self.selection.to_json()
        data["dnll_eval"] = self.dnll_eval.dnll
        data["dnll_eval_interval"] = [self.dnll_eval.low, self.dnll_eval.high]
        data["divergence_eval"] = self.divergence_eval.to_json()
        data["budget"] = dataclasses.asdict(self.selection.budget)  # the limits the picture draws
        return data


def auto(model_path: str | Path, out: str | Path, settings: JobSettings = JobSettings(), progress: Tell | None = None) -> tuple[Outcome, Path]:
    """Select, rewrite, measure and write: the main job (`surgery parallelize --layers auto`).

    Args:
        model_path: the exported model: an .onnx file, or a folder holding one.
        out: where to write the rewritten model, like its input (`write`), with selection.json and its picture beside it; never the input.
        settings: what to read, fit, choose, measure and keep (JobSettings).
        progress: called as progress(stage, done, total) as each stage advances.

    Returns:
        The Outcome (selection.json's content: the Selection, the form written, dNLL and KL on the evaluation windows, speed-ups) and the .onnx path written.

    Raises:
        SurgeryError: `out` overwrites the input or cannot be written, a block cannot be fused (with `fused`; before any work), too small a corpus, or
            what select_layers refuses, or a work folder of another run (without `restart`).
    """
    tell, fit, greedy, options = progress or silent, settings.fit, settings.selection, settings.resources.options
    select.ranking(greedy.score, fit)  # a score the fit cannot give fails before any work
    if settings.tasks is not None:
        settings.tasks.check()  # so do unknown tasks and missing task data
    subject = Subject(graph.load(model_path), str(model_path))  # read once: the windows' samples, the selection, the rewrite and the measurements take it
    graph.check_output(out, model_path, subject.model)
    model, blocks = subject.model, subject.blocks
    if settings.fused:  # before any work: a block that cannot be fused would fail only after the fit and the selection
        _check_fusable(model, blocks[greedy.protect_first : len(blocks) - greedy.protect_last])
    if fit is not None:
        both = settings.data.windows(subject, fit.windows + greedy.windows, "calibration", tell)
        fit_part, sel = data.deal(both, [fit.windows, greedy.windows], ["fit", "selection"])
    else:
        fit_part, sel = None, settings.data.windows(subject, greedy.windows, "calibration", tell)
    ev = settings.data.windows(subject, settings.eval_windows, "evaluation", tell)
    parts = {"fit windows": fit_part, "selection windows": sel, "evaluation windows": ev}
    frontier = greedy.frontier
    with _work(out, model_path, model, parts, settings) as work:  # released however auto ends
        if frontier is not None and frontier.point is not None and frontier.point > (reached := measured_frontier.reached(frontier.of, work)):
            raise SurgeryError(f"--frontier-point {frontier.point}: the frontier of {frontier.of} reached {reached} points; choose one of 1..{reached}")
        own = work.scope(f"point-{frontier.point}") if frontier is not None and frontier.point else work  # a point's units beside its frontier's
        with settings.resources.pool() as pool:
            selection = select_layers(subject, sel, fit_windows=fit_part, fit=fit, settings=greedy, options=options, progress=tell, pool=pool, work=work)
            rewritten = parallel_form(subject, selection.layers, fused=settings.fused, fixes=selection.fixes).model
            seq_len, seconds = settings.data.seq_len, {}
            times = _branch_times(subject, seq_len, options, work)
            book = accuracy.ScoreBook(settings.tasks, options, tell, graph.resolve(model_path).parent, work.scope("tasks")) if settings.tasks else None
            walked = None
            if frontier is not None and frontier.point is None:
                start = time.perf_counter()
                walked = _frontier(subject, selection, ev, settings, times, book, pool, tell, work)
                seconds["frontier"] = time.perf_counter() - start
            held_out = _held_out(walked) if walked is not None and walked.budget_point else _evaluation(model, rewritten, ev, options, tell, own, seconds)
            prefill, decode, timed = _latency(model, rewritten, seq_len, settings.latency, options, tell) if settings.latency.measure else (None,) * 3
        tasks = _tasks(model, rewritten, book, len(selection.layers) if frontier else None, seconds) if book else None
        outcome = Outcome(
            selection=selection, form=selection.describe(settings.fused), base_loss_eval=held_out[0], dnll_eval=held_out[1],
            eval_tokens=ev.tokens, divergence_eval=held_out[2], estimated_speedup=times.estimated_speedup(selection.layers),
            prefill_ratio=prefill, decode_ratio=decode, latency=timed,
            windows={name: w.describe() for name, w in (("fit", fit_part), ("selection", sel), ("evaluation", ev)) if w is not None},
            estimate_placement=str(times.placement), resumed=work.resumed(), seconds=seconds, checkpoints=work.cost, tasks=tasks,
            frontier=walked.to_json() if walked else None,
        )
        written = _write(outcome, rewritten, out, model_path)
        if frontier is None:
            work.finish()  # a frontier's work folder stays: --frontier-point reads its points from it
    return outcome, written


def _branch_times(subject: Subject, seq_len: int, options: runtime.Options, work: Checkpoints) -> timing.BranchTimes:
    """The kernel times of the speed estimate (on the latency's device), profiled once per work folder: a resumed run,
    and a --frontier-point run, estimate from the times the first run measured."""
    if (times := work.load("branch-times")) is None:
        times = timing.branch_times(subject, seq_len=seq_len, runs=3, options=options)
        work.save("branch-times", times)
    return times


def _frontier(subject: Subject, selection: Selection, ev: data.Windows, settings: JobSettings, times, book, pool, tell: Tell,
              work: Checkpoints) -> measured_frontier.Frontier:
    """Every point of the selection's path measured (frontier.measure): held out, speed, and tasks and latency where asked."""
    options, frontier = settings.resources.options, settings.selection.frontier
    graph_of = lambda forms: parallel_form(subject, sorted(forms), fused=settings.fused,  # noqa: E731
                                           fixes={l: selection.fits[l].fix for l, f in forms.items() if f == "compensated"}).model
    latency = None
    if frontier.latency:
        def latency(rewritten):
            prefill, decode, _ = _latency(subject.model, rewritten, settings.data.seq_len, settings.latency, options, tell)
            return {"prefill": prefill, "decode": decode}
    measures = measured_frontier.Measures(subject, times, graph_of, book, latency)
    return measured_frontier.measure(selection, ev, frontier, measures, pool=pool, options=options, tell=tell, work=work)


def _write(outcome: Outcome, rewritten: ir.Model, out, model_path) -> Path:
    """Write the rewritten model like its input, with selection.json and its picture beside it (`MODEL.selection.json` for a file)."""
    report = "selection.json" if Path(model_path).is_dir() else Path(out).with_suffix(".selection.json").name
    saved = outcome.to_json()
    extra = {report: json.dumps(saved, indent=2), Path(report).with_suffix(".png").name: selection_picture(saved)}
    if outcome.frontier is not None:  # frontier.json and its picture beside them
        name = report.replace("selection.json", "frontier.json")
        extra |= {name: json.dumps(outcome.frontier, indent=2), Path(name).with_suffix(".png").name: frontier_picture(outcome.frontier)}
    return graph.write(rewritten, out, like=model_path, extra=extra)


def _evaluation(model: ir.Model, rewritten: ir.Model, ev: data.Windows, options: runtime.Options, tell: Tell, work: Checkpoints,
                seconds: dict[str, float]) -> tuple[float, Delta, statistics.Divergence]:
    """The original's loss on the evaluation windows and the rewritten model's dNLL and KL against it (the scores a
    checkpoint unit); adds the seconds they took to `seconds`. Sessions of models in memory hand their weights to ORT
    without serializing them (runtime.session)."""
    start = time.perf_counter()
    if (scored := work.load("evaluation")) is None:
        step = counter(tell, "evaluation windows", 2 * len(ev))
        scored = scoring.compare([model, rewritten], ev, options=options, progress=lambda i, n: step(n))
        work.save("evaluation", scored)
    base, after = scored
    seconds["evaluation"] = time.perf_counter() - start
    return base.loss, statistics.delta(base, after), statistics.divergence(after, base)


def _held_out(frontier: measured_frontier.Frontier) -> tuple[float, Delta, statistics.Divergence]:
    """The budget's point on the evaluation windows, as the frontier measured it (the same numbers as `_evaluation`'s
    to 1e-6: tests/test_frontier.py), so the main job does not score it again."""
    point = frontier.points[frontier.budget_point - 1]
    return frontier.base_loss, point.dnll, point.divergence


def _tasks(model: ir.Model, rewritten: ir.Model, book: accuracy.ScoreBook, point: int | None, seconds: dict[str, float]) -> dict:
    """Both models' accuracy on the downstream tasks (a checkpoint unit each, in `book`; with a frontier the rewritten model
    is its point `point`, which the frontier may have scored already); adds its seconds to `seconds`."""
    start = time.perf_counter()
    name = "rewritten" if point is None else f"point-{point}"
    book.scores(model, "original")
    book.scores(rewritten, name)
    seconds["tasks"] = time.perf_counter() - start
    return dataclasses.replace(book.compare(["original", name]), names=("original", "rewritten")).to_json()


def _work(out, model_path, model: ir.Model, windows: dict[str, data.Windows | None], settings: JobSettings) -> Checkpoints:
    """The main job's work folder beside `out` (with --frontier-point, the frontier run's, which must exist), tied to the
    model's bytes, the windows' tokens, the settings that change results (JobSettings.results; the device) and surgery's
    version; not to those that change only speed. Off without checkpoints."""
    frontier = settings.selection.frontier
    of = frontier.of if frontier is not None and frontier.point is not None else None
    if of is not None and not checkpoint.work_folder(of).is_dir():
        raise SurgeryError(f"--frontier-of {of}: no work folder {checkpoint.work_folder(of)}; run `surgery parallelize ... -o {of} --frontier` first")
    if not settings.checkpoints:
        if frontier is not None:
            raise SurgeryError("--frontier keeps its points in the work folder (for --frontier-point); drop --no-checkpoints")
        return Checkpoints.off()
    fingerprint = {"model": model_digest(model_path, model),
                   **{name: digest(w.ids) for name, w in windows.items() if w is not None},
                   "device": runtime.providers(settings.resources.options.device)[0],
                   **{k: str(v) for k, v in settings.results().items()}}
    return Checkpoints.open(of or out, fingerprint, restart=settings.restart and of is None)


def _check_fusable(model: ir.Model, blocks: list[BlockMap]) -> None:
    """Refuse --fuse when one of the sequential `blocks` (those auto may choose) cannot be fused."""
    for block in blocks:
        if not block.is_parallel and (why := fuse_refusal(model, block)) is not None:
            raise SurgeryError(f"{why} (--fuse applies to every chosen block; drop --fuse or protect the block)")


def _latency(model: ir.Model, rewritten: ir.Model, seq_len: int, latency: LatencySettings, options: runtime.Options,
             tell: Tell) -> tuple[float, float | None, dict]:
    """Prefill and decode speed-ups (original / rewritten; decode None when either has no decode time) from one
    interleaved run of both, and the run's timings."""
    timed = timing.latency([model, rewritten], batch=latency.batch, seq_len=seq_len, repeats=latency.repeats, warmup=latency.warmup,
                           options=options, progress=counter(tell, "latency (interleaved)", latency.repeats))
    prefill = timed[0].prefill_ms / timed[1].prefill_ms
    decode = timed[0].decode_ms / timed[1].decode_ms if timed[0].decode_ms and timed[1].decode_ms else None
    return prefill, decode, {"original": dataclasses.asdict(timed[0]), "rewritten": dataclasses.asdict(timed[1])}
