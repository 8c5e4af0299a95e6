"""The main job's selection as a PNG (selection.png beside selection.json): the greedy's trace against the budget
above, the per-layer scores and the chosen blocks' forms below."""

from __future__ import annotations

import io

import numpy as np


def selection_picture(outcome: dict) -> bytes:
    """The main job's selection as a PNG: the greedy's trace against the budget above, the per-layer scores and the
    chosen blocks' forms below. `outcome`: selection.json's dict, so a saved selection can be drawn again."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    selection, budget = outcome["selection"], outcome.get("budget") or {}
    fig, (kl, dnll, scores) = plt.subplots(3, 1, figsize=(8, 8.4), gridspec_kw={"height_ratios": [1, 1, 1.2]})
    trials = selection["trials"]
    _plot_trace(kl, trials, "kl", ("kl_low", "kl_high"), budget.get("max_kl"), "--max-kl", "KL vs original, nats", log=True)
    _plot_trace(dnll, trials, "dnll", ("low", "high"), budget.get("max_loss_increase"), "--max-loss-increase", "dNLL, nats", log=False)
    kl.set_title("Greedy trace: the chosen set plus each candidate, selection windows (95 % intervals)", fontsize=9)
    dnll.set_xlabel("trial: block and form (c compensated, p plain), in the order tried", fontsize=8)
    _plot_selection_scores(scores, selection)
    final, refit = selection.get("divergence"), " after the refit" if (selection.get("refit") or {}).get("kept") else ""
    stopped = f"\nstopped: {selection['stopped']}" if selection.get("stopped") else ""
    fig.suptitle(f"surgery parallelize: {len(selection['layers'])} of {selection.get('candidates', len(selection['blocks']))} candidate blocks"
                 f" chosen ({outcome.get('form', '')}); KL {'n/a' if final is None else format(final['kl'], '.4g')}, dNLL {selection['dnll']['dnll']:+.4f}{refit}"
                 f"{stopped}", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


_FORM_COLOR = {"compensated": "#55a868", "plain": "#dd8452"}


def _plot_trace(ax, trials: list[dict], key: str, bounds: tuple[str, str], limit: float | None, flag: str, label: str, *, log: bool) -> None:
    """One measure of each trial (kept: filled, missed: hollow, coloured by form) with its interval, the chosen set's
    value after each trial as a step line, and the budget's limit."""
    if not trials:
        ax.text(0.5, 0.5, "no trials: no sequential block could be chosen", ha="center", va="center", transform=ax.transAxes)
    x = np.arange(1, len(trials) + 1)
    values = _arr([t[key] for t in trials])
    chosen, current = [], 0.0
    for t in trials:
        current = t[key] if t["kept"] else current
        chosen.append(current)
    if trials:
        chosen = np.array(chosen, dtype=float)
        ax.step(x, np.where(chosen > 0, chosen, np.nan) if log else chosen, where="post", color="#4c72b0", lw=1.2, label="chosen set")
    for t, xi, v in zip(trials, x, values):
        color = _FORM_COLOR.get(t["form"], "gray")
        ax.errorbar(xi, v, yerr=[[max(v - t[bounds[0]], 0)], [max(t[bounds[1]] - v, 0)]], fmt="o", ms=6, color=color,
                    mfc=color if t["kept"] else "white", capsize=2)
    if limit is not None:
        ax.axhline(limit, color="#c44e52", ls="--", lw=1, label=f"{flag} {limit:g}")
    if not log:
        ax.axhline(0, color="k", lw=0.5)
    for form, color in _FORM_COLOR.items():
        ax.plot([], [], "o", color=color, label=f"{form}, kept")
    ax.plot([], [], "o", color="gray", mfc="white", label="missed the budget")
    ax.set(ylabel=label, yscale="log" if log and (values[np.isfinite(values)] > 0).any() else "linear", xlim=(0.4, max(len(trials), 1) + 0.6))
    ax.set_xticks(x, [f"{t['layer']}{t['form'][0]}" for t in trials], fontsize=7 if len(trials) > 16 else 9)
    ax.legend(fontsize=7, loc="best")


def _plot_selection_scores(ax, selection: dict) -> None:
    """C_l, C_l^stream and C_l^comp per candidate layer (the ranking score bold), the chosen blocks shaded by form."""
    import matplotlib.ticker

    blocks = selection["blocks"]
    layers = np.array([b["layer"] for b in blocks])
    for layer, form in selection["forms"].items():
        ax.axvspan(int(layer) - 0.4, int(layer) + 0.4, color=_FORM_COLOR.get(form, "gray"), alpha=0.25, lw=0)
    if not blocks:
        ax.text(0.5, 0.5, "no sequential blocks to score", ha="center", va="center", transform=ax.transAxes)
    names = {"c": "C_l", "c_stream": "C_l stream", "c_comp": "C_l comp"}
    drawn = []
    for key, style, color in (("c", "o-", "#4c72b0"), ("c_stream", "s--", "#8172b2"), ("c_comp", "d-", "k")):
        values = _arr([b[key] for b in blocks])
        if np.isnan(values).all():
            continue
        ranks, drawn = key == selection["score"], drawn + [values]
        ax.plot(layers, values, style, color=color, ms=5 if ranks else 3, lw=2.2 if ranks else 0.8,
                label=names[key] + (" (ranks, lowest first)" if ranks else ""))
    for form, color in _FORM_COLOR.items():
        ax.fill_between([], [], color=color, alpha=0.25, label=f"chosen, {form}")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    positive = any((v[np.isfinite(v)] > 0).any() for v in drawn)
    ax.set(xlabel="layer", ylabel="defect", yscale="log" if positive else "linear", title="Per-layer scores; chosen blocks shaded by the form written")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="best")


def _arr(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def frontier_series(frontier: dict) -> dict[str, np.ndarray]:
    """What frontier.png draws, per point (NaN where a point was not measured): k, held-out KL and dNLL with their
    intervals, the speed estimate, the measured prefill and decode ratios, and the accuracy kept with its interval."""
    points = frontier["points"]
    get = lambda f: np.array([np.nan if (v := f(p)) is None else v for p in points], dtype=float)  # noqa: E731
    e = lambda key, i=None: get(lambda p: p["evaluation"][key] if i is None else p["evaluation"][key][i])  # noqa: E731
    measured = lambda key: get(lambda p: (p["speedup_measured"] or {}).get(key))  # noqa: E731
    kept = lambda i: get(lambda p: p["tasks"]["kept"][i] if p["tasks"] else None)  # noqa: E731
    return {"k": get(lambda p: p["k"]), "kl": e("kl"), "kl_low": e("kl_interval", 0), "kl_high": e("kl_interval", 1),
            "dnll": e("dnll"), "dnll_low": e("dnll_interval", 0), "dnll_high": e("dnll_interval", 1),
            "estimate": get(lambda p: p["speedup_estimate"]), "prefill": measured("prefill"), "decode": measured("decode"),
            "kept": kept(0), "kept_low": kept(1), "kept_high": kept(2)}


def frontier_picture(frontier: dict) -> bytes:
    """frontier.png: held-out KL and dNLL with their 95 % intervals against the blocks rewritten, the budget's point and
    the ceiling marked (above); the accuracy kept where measured and the speed, estimated and measured, on a second axis
    (below). `frontier`: frontier.json's dict, so a saved frontier can be drawn again."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = frontier_series(frontier)
    fig, (quality, trade) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True)
    dnll_axis = quality.twinx()
    quality.errorbar(s["k"], s["kl"], yerr=_bars(s["kl"], s["kl_low"], s["kl_high"]), fmt="o-", color="#4c72b0", capsize=2, label="KL")
    dnll_axis.errorbar(s["k"] + 0.15, s["dnll"], yerr=_bars(s["dnll"], s["dnll_low"], s["dnll_high"]), fmt="s--", color="#dd8452", capsize=2, label="dNLL")
    for ax in (quality, trade):
        ax.axvline(frontier["budget_point"], color="#c44e52", ls=":", lw=1.2, label=f"the budget's point ({frontier['budget_point']} blocks)")
    if (ceiling := frontier["ceiling"].get("max_kl")) is not None and np.nanmax(s["kl_high"], initial=0) > 0.5 * ceiling:
        quality.axhline(ceiling, color="gray", ls="--", lw=1, label=f"--frontier-max-kl {ceiling:g} (selection windows)")
    quality.set(ylabel="KL vs original, nats")
    dnll_axis.set_ylabel("dNLL, nats", color="#dd8452")
    handles = [h for ax in (quality, dnll_axis) for h in ax.get_legend_handles_labels()[0]]
    quality.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper left")
    quality.set_title("Held-out evaluation windows, 95 % intervals", fontsize=9)
    speed = trade.twinx()
    speed.plot(s["k"], s["estimate"], "d-", color="k", ms=4, label="speed, paper's estimate")
    for key, style in (("prefill", "^-"), ("decode", "v-")):
        if np.isfinite(s[key]).any():
            speed.plot(s["k"], s[key], style, ms=5, label=f"speed, measured {key}")
    speed.set_ylabel("speed-up, original / point")
    if np.isfinite(s["kept"]).any():
        at = np.isfinite(s["kept"])
        trade.errorbar(s["k"][at], 100 * s["kept"][at], yerr=100 * _bars(s["kept"], s["kept_low"], s["kept_high"])[:, at], fmt="o",
                       color="#55a868", capsize=3, label="task accuracy kept, %")
        trade.axhline(100, color="#55a868", lw=0.5)
    else:
        trade.text(0.02, 0.5, "no task accuracy measured (--tasks)", transform=trade.transAxes, fontsize=8, color="gray")
    trade.set(xlabel="blocks rewritten (point k)", ylabel="accuracy kept, %")
    trade.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    handles = [h for ax in (trade, speed) for h in ax.get_legend_handles_labels()[0]]
    trade.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="lower left")
    fig.suptitle(f"surgery parallelize --frontier: {len(frontier['points'])} points; stopped: {frontier['stopped'] or 'at the budget'}", fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _bars(value: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Error bar lengths below and above each value (never negative)."""
    return np.maximum(np.stack([value - low, high - value]), 0)
