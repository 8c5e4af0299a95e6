"""The `surgery evaluate` job: models scored side by side on one corpus's windows (loss, dNLL, KL, top-1 against the
first) and timed with their repeats interleaved, one row of numbers per model; or, with --tasks, their accuracy on
downstream tasks. report/evaluation.py lays both out."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from surgery.engine import runtime
from surgery.engine.progress import Tell, counter, silent
from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.measure import scoring, statistics, timing
from surgery.tasks import accuracy
from surgery.text.data import DataSettings, Windows


def side_by_side(models: Sequence, names: Sequence[str], data: DataSettings, max_windows: int | None = None, part: str = "evaluation",
                 batch_size: int = 1, timed: timing.LatencySettings = timing.LatencySettings(), options: runtime.Options = runtime.Options(),
                 progress: Tell | None = None) -> tuple[Windows, list[dict]]:
    """What `surgery evaluate` measures: the models scored on `max_windows` windows of the corpus's `part` (`compare`), then their
    latency with the repeats interleaved (when `timed.measure`); the windows and one row per model (`rows`). progress(stage, done,
    total), one stage per model's perplexity and one for the latency."""
    tell = progress or silent
    for model in models:
        graph.resolve(model)  # every path checked before minutes of work
    timing.check_seq_len(models[0], data.seq_len, decode=timed.measure)
    windows = data.windows(models[0], max_windows, part, tell)
    scored = [counter(tell, f"perplexity {name}", len(windows)) for name in names]
    scores = scoring.compare(models, windows, batch_size=batch_size, options=options, progress=lambda i, n: scored[i](n))
    timings = []
    if timed.measure:
        timings = timing.latency(models, batch=timed.batch, seq_len=data.seq_len, repeats=timed.repeats, warmup=timed.warmup, options=options,
                                 progress=counter(tell, "latency (interleaved)", timed.repeats))
    return windows, rows(models, names, scores, timings)


def rows(models: Sequence, names: Sequence[str], scores: Sequence[statistics.Perplexity], timings: Sequence[timing.Latency] = ()) -> list[dict]:
    """What `surgery evaluate` prints per model, from `compare` (and `latency`): loss, dNLL vs the first with its
    interval, KL / its interval / p99 / top-1 agreement / llama.cpp's statistics vs the first (None for the first), latency and ratios."""
    out = []
    for i, (model, name, score) in enumerate(zip(models, names, scores)):
        d = None if i == 0 else statistics.delta(scores[0], score)
        row = {"model": str(model), "name": name, **score.summary(), "dnll": score.loss - scores[0].loss,
               "dnll_interval": None if d is None else [d.low, d.high]}
        row |= statistics.divergence(score, scores[0]).to_json() if i else dict.fromkeys(("kl", "kl_interval", "kl_p99", "top1_agreement", "llama_cpp"))
        if timings:
            t, t0 = timings[i], timings[0]
            row.update(dataclasses.asdict(t))
            row["placement"] = str(t.placement) if t.placement else runtime.short_name(t.provider)
            row["on_cpu"] = dict(t.placement.on_cpu) if t.placement else None
            row["prefill_ratio"] = t0.prefill_ms / t.prefill_ms
            row["decode_ratio"] = t0.decode_ms / t.decode_ms if t.decode_ms and t0.decode_ms else None
        out.append(row)
    return out


def max_windows(text: str) -> int | None:
    """--max-windows: a whole number of at least 1, or `all` (None)."""
    if text.strip().lower() == "all":
        return None
    with contextlib.suppress(ValueError):
        if int(text) >= 1:
            return int(text)
    raise SurgeryError(f"--max-windows {text}: give a whole number of at least 1, or `all`")


def short_names(paths: Sequence[Path]) -> list[str]:
    """The models' names in a table: a file's name, or a folder's for model.onnx; whole paths when two would read alike."""
    names = [p.name if p.name != "model.onnx" else p.parent.name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def tasks_side_by_side(models: Sequence, names: Sequence[str], settings: accuracy.TaskSettings, options: runtime.Options = runtime.Options(),
                       progress: Tell | None = None) -> accuracy.Comparison:
    """What `surgery evaluate --tasks` measures: every model on every task of `settings`; task names, task data and every
    model path are checked before any model loads."""
    settings.check()
    for model in models:
        graph.resolve(model)
    return accuracy.task_accuracy(models, names, settings, options, progress=progress)
