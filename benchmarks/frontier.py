"""The tables RESULTS and README show of a `surgery parallelize --frontier` run, from its frontier.json: every point
(the block it adds, held-out KL and dNLL with their 95 % intervals, top-1, the speed estimate and measured ratios) and
the measured points' task accuracy (each task's headline accuracy and the accuracy kept with its interval), and where
the accuracy kept first falls below 99 % and 95 % (point estimate and interval's upper end).

    python benchmarks/frontier.py OUT/frontier.json [OTHER/frontier.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import table


def points(frontier: dict) -> str:
    rows = []
    for p in frontier["points"]:
        e, s = p["evaluation"], p["selection"]
        measured = p["speedup_measured"]
        rows.append({
            "k": f"{p['k']}{' (budget)' if p['k'] == frontier['budget_point'] else ''}", "adds": f"{p['layer']}{p['form'][0]}",
            "selection KL": f"{s['kl']:.4f}",
            "held-out KL [95 % CI]": f"{e['kl']:.4f} [{e['kl_interval'][0]:.4f}, {e['kl_interval'][1]:.4f}]",
            "held-out dNLL [95 % CI]": f"{e['dnll']:+.4f} [{e['dnll_interval'][0]:+.4f}, {e['dnll_interval'][1]:+.4f}]",
            "top-1 %": f"{100 * e['top1_agreement']:.1f}", "speed, estimate": f"{p['speedup_estimate']:.3f}x",
            "speed, measured": f"{measured['prefill']:.3f}x / {measured['decode']:.3f}x" if measured else "",
            "accuracy kept [95 % CI]": _kept(p["tasks"]) if p["tasks"] else "",
        })
    columns = list(rows[0]) if rows else []
    return table(rows, [c for c in columns if any(r[c] for r in rows)])


def tasks(frontier: dict) -> str:
    info = frontier["tasks"]
    if not info:
        return "(no task accuracy measured)"
    measured = [p for p in frontier["points"] if p["tasks"]]
    rows = [{"task": f"{name} ({info['documents'][name]})", "original": f"{100 * info['original'][name]:.1f}",
             **{f"k={p['k']}": f"{100 * p['tasks']['accuracy'][name]:.1f}" for p in measured}} for name in info["names"]]
    rows.append({"task": "average", "original": f"{100 * sum(info['original'].values()) / len(info['original']):.2f}",
                 **{f"k={p['k']}": f"{100 * p['tasks']['average']:.2f}" for p in measured}})
    rows.append({"task": "**accuracy kept** [95 % CI]", "original": "100 %", **{f"k={p['k']}": _kept(p["tasks"]) for p in measured}})
    return table(rows, ["task", "original", *[f"k={p['k']}" for p in measured]])


def falls(frontier: dict) -> str:
    """Where the accuracy kept first falls below 99 % and 95 % among the measured points."""
    measured = [p for p in frontier["points"] if p["tasks"]]
    words = []
    for level in (0.99, 0.95):
        point = next((p["k"] for p in measured if p["tasks"]["kept"][0] < level), None)
        upper = next((p["k"] for p in measured if p["tasks"]["kept"][2] < level), None)
        words.append(f"below {100 * level:.0f} %: the point estimate first at {f'k={point}' if point else 'no measured point'}, "
                     f"the whole interval first at {f'k={upper}' if upper else 'no measured point'}")
    return "; ".join(words)


def _kept(t: dict) -> str:
    kept, low, high = t["kept"]
    return f"{100 * kept:.1f} % [{100 * low:.1f}, {100 * high:.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("frontiers", nargs="+", type=Path, help="frontier.json files")
    for path in parser.parse_args().frontiers:
        frontier = json.loads(path.read_text())
        print(f"## {path}: {len(frontier['points'])} points, the budget's at {frontier['budget_point']}; stopped: {frontier['stopped']}\n")
        print(points(frontier), "\n")
        print(tasks(frontier), "\n")
        if frontier["tasks"]:
            print("Accuracy kept", falls(frontier), "\n")


if __name__ == "__main__":
    main()
