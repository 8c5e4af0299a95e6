"""Write a diagnose report: report.json, report.md and report.html beside PNG plots (matplotlib).

Structure: `write` (the folder) and `summary` (the headline numbers) take diagnose()'s Diagnosis; everything
below them reads its report.json form (`Diagnosis.to_json()`): `markdown` (the summary, ablation and per-layer
tables), `_html` (the same page as HTML), `_plots` (one `_plot_<section>` per section that ran, saved by `_save`),
and the number formatting of surgery.report.numbers (`number`, `with_interval`).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from surgery.files import output
from surgery.report.numbers import number, with_interval

if TYPE_CHECKING:
    from surgery.diagnostics.diagnose import Diagnosis

SCHEMA = Path(__file__).with_name("schema.json")
PAPER_MLP = {"tangential": "+0.07..+1.72", "radial": "+7.19..+12.96"}  # the paper's loss increase with the mlp of every layer so edited


def write(diagnosis: Diagnosis, out_dir: str | Path) -> Path:
    """Write the report folder atomically; return its path."""
    report = diagnosis.to_json()
    out_dir = Path(out_dir)
    with output.folder(out_dir) as partial:
        plots = _plots(report, partial)
        (partial / "report.json").write_text(json.dumps(report, indent=2))
        (partial / "report.md").write_text(markdown(report, plots))
        (partial / "report.html").write_text(_html(report, plots))
    return out_dir


def summary(diagnosis: Diagnosis) -> dict:
    """The headline numbers, as `--json` prints them."""
    return _summary(diagnosis.to_json())


def _summary(report: dict) -> dict:
    """summary() of a report in its report.json form."""
    out: dict = {"model": report["model"]["path"], "n_layers": report["model"]["n_layers"]}
    if "deficit" in report:
        out["mean_deficit"] = report["deficit"]["mean"]
    if "diversity" in report:
        out["mean_d_attn"] = _mean(report["diversity"]["d_attn"])
        out["mean_d_mlp"] = _mean(report["diversity"]["d_mlp"])
    for measure, prefix in (("spearman", "spearman_"), ("spearman_kl", "spearman_kl_")):
        for score, value in report.get("defect", {}).get(measure, {}).items():  # c, c_stream (plain runs), c_comp (compensated runs)
            out[prefix + score] = value
    if "ablation" in report:
        out["ablation_all_layers"] = report["ablation"]["all_layers"]
        if "all_layers_interval" in report["ablation"]:
            out["ablation_all_layers_interval"] = report["ablation"]["all_layers_interval"]
        if "all_layers_keep_sink" in report["ablation"]:
            out["ablation_all_layers_keep_sink"] = report["ablation"]["all_layers_keep_sink"]
    if "critical" in report:
        out["critical_counts"] = {k: sum(l["counts"][k] for l in report["critical"]["layers"]) for k in ("attractor", "saddle", "repeller")}
    return out


def markdown(report: dict, plots: dict[str, str] | None = None) -> str:
    plots = plots or {}
    n = report["model"]["n_layers"]
    lines = [f"# surgery diagnose: {report['model']['path']}", ""]
    cal = report["windows"]["calibration"]
    lines.append(f"{n} blocks ({_forms(report)}). Scores from {cal['count']} calibration windows x {cal['seq_len']} tokens of {cal['corpus']}" + (
        f"; losses from {report['windows']['evaluation']['count']} evaluation windows." if "evaluation" in report["windows"] else "."))
    lines.append("Token 0 (the attention sink) is left out of every average.")
    s = _summary(report)
    lines += ["", "| summary | value |", "|---|---|"]
    for key, value in s.items():
        if key in ("model", "ablation_all_layers", "ablation_all_layers_interval", "ablation_all_layers_keep_sink", "critical_counts"):
            continue
        lines.append(f"| {key} | {number(value)} |")
    notes = report.get("defect", {}).get("c_comp_note", {})
    for why in dict.fromkeys(notes.values()):  # each reason once, with its blocks
        lines += ["", f"No fix fitted (C_comp, compensated runs) at block(s) {', '.join(l for l, w in notes.items() if w == why)}: {why}."]
    if "ablation" in report:
        a = report["ablation"]
        kept = a.get("all_layers_keep_sink", {})
        lines += ["", "## Ablations, all layers at once (dNLL, nats, 95 % paired bootstrap interval)", "",
                  "Sink kept: tokens at position 0 (the attention sink) keep their branch output. The paper's mlp ranges",
                  f"(models from GPT-2 to Llama-3-8B): tangential {PAPER_MLP['tangential']}, radial {PAPER_MLP['radial']}.", "",
                  "| branch | tangential | tangential, sink kept | radial | radial, sink kept | remove |", "|---|---|---|---|---|---|"]
        for branch in ("mlp", "attn"):
            row, ci = a["all_layers"][branch], a.get("all_layers_interval", {}).get(branch, {})
            sink, sink_ci = kept.get(branch, {}), a.get("all_layers_keep_sink_interval", {}).get(branch, {})
            cells = [with_interval(row["tangential"], ci.get("tangential")), with_interval(sink.get("tangential"), sink_ci.get("tangential")),
                     with_interval(row["radial"], ci.get("radial")), with_interval(sink.get("radial"), sink_ci.get("radial")),
                     with_interval(row["remove"], ci.get("remove"))]
            lines.append(f"| {branch} | " + " | ".join(cells) + " |")
    columns = [("deficit", lambda r, l: r["deficit"]["deficit"][l]),
               ("d_attn", lambda r, l: r["diversity"]["d_attn"][l]), ("d_mlp", lambda r, l: r["diversity"]["d_mlp"][l]),
               ("C", lambda r, l: r["defect"]["c"][l]), ("C_stream", lambda r, l: r["defect"]["c_stream"][l]),
               ("dNLL parallel [95 % CI]", lambda r, l: with_interval(r["defect"].get("dnll_parallel", [None] * n)[l],
                                                                  r["defect"].get("dnll_parallel_interval", [None] * n)[l])),
               ("KL parallel", lambda r, l: r["defect"].get("kl_parallel", [None] * n)[l]),
               ("top-1 parallel", lambda r, l: r["defect"].get("top1_parallel", [None] * n)[l]),
               ("C_comp", lambda r, l: r["defect"].get("c_comp", [None] * n)[l]),
               ("dNLL compensated [95 % CI]", lambda r, l: with_interval(r["defect"].get("dnll_compensated", [None] * n)[l],
                                                                     r["defect"].get("dnll_compensated_interval", [None] * n)[l])),
               ("KL compensated", lambda r, l: r["defect"].get("kl_compensated", [None] * n)[l]),
               ("top-1 compensated", lambda r, l: r["defect"].get("top1_compensated", [None] * n)[l]),
               ("alpha", lambda r, l: r["gate"]["alpha"][l])]
    present = [(name, get) for name, get in columns if _has(report, get)]
    if present:
        lines += ["", "## Per layer", "", "| layer | form | " + " | ".join(n for n, _ in present) + " |", "|---|---|" + "---|" * len(present)]
        for l in range(n):
            lines.append(f"| {l} | {report['model']['forms'][l]} | " + " | ".join(number(get(report, l)) for _, get in present) + " |")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{title}]({file})" for title, file in plots.items()]
    return "\n".join(lines) + "\n"


def _html(report: dict, plots: dict[str, str]) -> str:
    body = markdown(report, {}).splitlines()
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>surgery diagnose</title>",
           "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}img{max-width:100%}</style></head><body>"]
    table: list[list[str]] = []
    for line in body + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-"):
                table.append([c.strip() for c in line.strip("|").split("|")])
            continue
        if table:
            out.append("<table>" + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table) + "</table>")
            table = []
        if line.startswith("# "):
            out.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            out.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line:
            out.append(f"<p>{html.escape(line)}</p>")
    for title, file in plots.items():
        out.append(f"<h3>{html.escape(title)}</h3><img src='{html.escape(file)}' alt='{html.escape(title)}'>")
    return "\n".join(out) + "</body></html>\n"


def _plots(report: dict, folder: Path) -> dict[str, str]:
    """Draw each section's plot that ran into `folder`; return {title: file name} in drawing order."""
    import matplotlib

    matplotlib.use("Agg")
    made: dict[str, str] = {}
    for section, plot in (("deficit", _plot_deficit), ("diversity", _plot_diversity), ("defect", _plot_defect),
                          ("ablation", _plot_ablation), ("critical", _plot_critical), ("prefix", _plot_prefix)):
        if section in report:
            fig, name, title = plot(report, np.arange(report["model"]["n_layers"]))
            _save(fig, folder / name)
            made[title] = name
    return made


def _save(fig, path: Path) -> None:
    """Integer ticks on each `layer` axis, then write the figure and close it."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    for ax in fig.axes:
        if ax.get_xlabel() == "layer":
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_deficit(report: dict, layers: np.ndarray):
    """Bars of each layer's angular deficit beside their mean."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(layers, _arr(report["deficit"]["deficit"]), color="#4c72b0")
    ax.axhline(report["deficit"]["mean"], color="k", ls="--", lw=1, label=f"mean {report['deficit']['mean']:.3f}")
    ax.set(xlabel="layer", ylabel="angular deficit 1 - a_l", title="Angular deficit")
    ax.legend()
    return fig, "deficit.png", "Angular deficit per layer"


def _plot_diversity(report: dict, layers: np.ndarray):
    """Token diversity at resid_pre, resid_mid and resid_post by layer."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for point, style in (("pre", "o-"), ("mid", "s--"), ("post", "^-")):
        ax.plot(layers, _arr(report["diversity"][point]["diversity"]), style, ms=3, label=f"resid_{point}")
    ax.set(xlabel="layer", ylabel="1 - mean pairwise cosine", title="Token diversity")
    ax.legend()
    return fig, "diversity.png", "Diversity at resid_pre, resid_mid, resid_post"


def _plot_defect(report: dict, layers: np.ndarray):
    """C_l, C_l^stream (and C_l^comp) on a log axis, the single-layer runs' dNLL (when measured) on a second axis."""
    import matplotlib.pyplot as plt

    defect = report["defect"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(layers, _arr(defect["c"]), "o-", ms=3, label="C_l")
    ax.plot(layers, _arr(defect["c_stream"]), "s-", ms=3, label="C_l stream")
    if "c_comp" in defect:
        ax.plot(layers, _arr(defect["c_comp"]), "d-", ms=3, label="C_l comp")
    ax.set(xlabel="layer", ylabel="defect", yscale="log", title="Sequential-to-parallel defect")
    if "dnll_parallel" in defect:
        twin = ax.twinx()
        twin.plot(layers, _arr(defect["dnll_parallel"]), "k^:", ms=3, label="dNLL (this layer parallel)")
        if "dnll_compensated" in defect:
            twin.plot(layers, _arr(defect["dnll_compensated"]), "kv:", ms=3, label="dNLL (this layer compensated)")
        twin.set_ylabel("dNLL, nats")
        twin.legend(loc="upper right")
    ax.legend(loc="upper left")
    return fig, "defect.png", "Defect scores beside measured dNLL"


def _plot_ablation(report: dict, layers: np.ndarray):
    """Each branch's all-layer ablations as bars, with their 95 % intervals when present."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    modes = ("tangential", "radial", "remove")
    for ax, branch in zip(axes, ("mlp", "attn")):
        values = [report["ablation"]["all_layers"][branch][m] for m in modes]
        ci = report["ablation"].get("all_layers_interval", {}).get(branch)
        yerr = None if ci is None else np.clip([[v - ci[m][0] for v, m in zip(values, modes)],
                                                [ci[m][1] - v for v, m in zip(values, modes)]], 0, None)
        ax.bar(modes, values, yerr=yerr, capsize=3, color=["#55a868", "#c44e52", "#8172b2"])
        ax.set(title=f"{branch}: all layers", ylabel="dNLL, nats")
    return fig, "ablation.png", "Ablations, all layers at once"


def _plot_critical(report: dict, layers: np.ndarray):
    """Stacked bars of each layer's critical points by type."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    bottom = np.zeros(len(layers))
    for kind, color in (("attractor", "#55a868"), ("saddle", "#dd8452"), ("repeller", "#c44e52")):
        counts = np.array([l["counts"][kind] for l in report["critical"]["layers"]], dtype=float)
        ax.bar(layers, counts, bottom=bottom, color=color, label=kind)
        bottom += counts
    ax.set(xlabel="layer", ylabel="critical points", title=f"Critical points of the mlp field ({report['critical']['seeds']} seeds per layer)")
    ax.legend()
    return fig, "critical.png", "Critical points by type"


def _plot_prefix(report: dict, layers: np.ndarray):
    """S_l(d) against distance for up to 6 evenly spread layers, log-log."""
    import matplotlib.pyplot as plt

    n = len(layers)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    curves = np.array(report["prefix"]["sensitivity"], dtype=float)
    for l in sorted(set(np.linspace(0, n - 1, min(n, 6)).astype(int))):
        ax.plot(report["prefix"]["distances"], curves[l], "o-", ms=3, label=f"layer {l}")
    ax.set(xscale="log", yscale="log", xlabel="distance d", ylabel="S_l(d)", title="Prefix sensitivity")
    ax.legend(fontsize=7)
    return fig, "prefix.png", "Prefix sensitivity curves"


def _arr(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _mean(values) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def _has(report, get) -> bool:
    try:
        get(report, 0)
        return True
    except (KeyError, IndexError):
        return False


def _forms(report) -> str:
    forms = report["model"]["forms"]
    return ", ".join(f"{forms.count(f)} {f}" for f in ("sequential", "parallel") if forms.count(f))


def summary_rows(diagnosis: Diagnosis) -> list[tuple[str, str]]:
    """The summary as (key, text) rows for a table: each ablation dNLL with its 95 % paired bootstrap interval."""
    summary = _summary(diagnosis.to_json())
    intervals = summary.pop("ablation_all_layers_interval", {})
    rows = []
    for key, value in summary.items():
        if key == "ablation_all_layers":
            value = "; ".join(f"{branch} " + ", ".join(f"{mode} {with_interval(x, intervals.get(branch, {}).get(mode))}" for mode, x in modes.items())
                              for branch, modes in value.items())
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v if not isinstance(v, dict) else {m: round(x, 4) for m, x in v.items()}}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.4f}"
        rows.append((key, str(value)))
    return rows
