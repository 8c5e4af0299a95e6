"""`surgery evaluate`'s tables: the columns of its score and latency rows (jobs/evaluate.rows), and the task table of
a Comparison (tasks/accuracy.py), every model after the first with its difference from the first and its interval."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from surgery.report.numbers import interval, kl_interval, pm, points, share
from surgery.tasks.accuracy import Comparison, paired


def _or_dash(key: str, cell: Callable[[dict], str]) -> Callable[[dict], str]:
    """A cell that reads row[key]: `-` where the row has none (the first model's KL, a graph without decode, ...)."""
    return lambda row: "-" if row.get(key) is None else cell(row)


# `surgery evaluate`'s table: (header, the cell of one `rows` row, which rows' table shows it: "score", or "latency" when timed).
# A new statistic is a field of its result (Perplexity / Divergence / Latency), which to_json carries into the row, and a line here.
COLUMNS: tuple[tuple[str, Callable[[dict], str], str], ...] = (
    ("model", lambda r: r["name"], "score"),
    ("loss", lambda r: f"{r['loss']:.4f}", "score"),
    ("ppl", lambda r: f"{r['perplexity']:.3f}", "score"),
    ("dNLL", lambda r: f"{r['dnll']:+.4f}", "score"),
    ("95 % CI", _or_dash("dnll_interval", lambda r: interval(r["dnll_interval"])), "score"),
    ("KL", _or_dash("kl", lambda r: f"{r['kl']:.4f}"), "score"),
    ("95 % CI ", _or_dash("kl", lambda r: kl_interval(r["kl_interval"])), "score"),
    ("KL p99", _or_dash("kl", lambda r: f"{r['kl_p99']:.4f}"), "score"),
    ("top-1", _or_dash("kl", lambda r: f"{100 * r['top1_agreement']:.1f} %"), "score"),
    ("Same top p", _or_dash("llama_cpp", lambda r: pm(r["llama_cpp"], "Same top p")), "score"),
    ("99.9% KLD", _or_dash("llama_cpp", lambda r: f"{r['llama_cpp']['99.9% KLD']:.4f}"), "score"),
    ("RMS Δp", _or_dash("llama_cpp", lambda r: pm(r["llama_cpp"], "RMS Δp")), "score"),
    ("provider", lambda r: r["placement"], "latency"),  # where ORT ran the nodes: CUDA, or CUDA (CPU: the ops it left on the host)
    ("prefill ms", lambda r: f"{r['prefill_ms']:.2f}", "latency"),
    ("decode ms/tok", _or_dash("decode_ms", lambda r: f"{r['decode_ms']:.2f}"), "latency"),
    ("prefill x", lambda r: f"{r['prefill_ratio']:.3f}", "latency"),
    ("decode x", _or_dash("decode_ratio", lambda r: f"{r['decode_ratio']:.3f}"), "latency"),
)


def columns(timed: bool) -> list[tuple[str, Callable[[dict], str]]]:
    """The columns of `surgery evaluate`'s table: the scores', and the latency's when it was timed."""
    return [(header, cell) for header, cell, shown in COLUMNS if shown == "score" or timed]


def task_table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """What `surgery evaluate --tasks` prints: a header and one row per task and metric, then the average of the headline
    metrics and the accuracy kept; every model after the first with its difference from the first and its interval."""
    names = comparison.names
    header = ["task", "metric", "docs", *names]
    rows = []
    for t, task in enumerate(comparison.tasks):
        for metric in task.metrics:
            base = comparison.scores[0][t]
            cells = [f"{100 * base.accuracy(metric):.1f}"]
            for scores in comparison.scores[1:]:
                d, lo, hi = paired(base.correct(metric), scores[t].correct(metric))
                cells.append(f"{100 * scores[t].accuracy(metric):.1f} ({points(d, lo, hi)})")
            rows.append([task.name, metric + (" *" if metric == task.headline else ""), str(len(base.gold)), *cells])
    average = [100 * float(np.mean([s.accuracy(s.task.headline) for s in scores])) for scores in comparison.scores]
    rows.append(["average *", "", "", *(f"{a:.1f}" for a in average)])
    rows.append(["kept", "", "", "", *(share(*comparison.kept(m)) for m in range(1, len(names)))])
    return header, rows


def task_legend(comparison: Comparison) -> str:
    """The line under the task table: what its marks mean, and each model's documents per second."""
    rates = ", ".join(f"{name} {sum(len(s.gold) for s in scores) / sum(s.seconds for s in scores):.1f}"
                      for name, scores in zip(comparison.names, comparison.scores))
    encoded = "" if comparison.like == "hf" else f"; tokenized as lm-eval's {comparison.like} backend (no BOS)"
    return ("* the metric the average takes; (difference from the first [paired 95 % interval], points); kept = average / the "
            f"first's average [95 % interval]. Documents per second: {rates}{encoded}")
