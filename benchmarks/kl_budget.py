"""Blocks kept under a KL budget, and what each kind of fix costs: SmolLM2-135M, --layers auto by method and --max-kl.

    python benchmarks/kl_budget.py [--budgets 0.02,0.05,0.1] [--methods plain,outputs,compensated,refit]
                                   [--fit-windows 64] [--windows 16]
                                   [--max-loss-increase none] [--png benchmarks/kl_vs_blocks.png]

Methods: plain (no fix, ranked by C_l^stream), outputs (the fix's output side alone, fitted to each block's own
defect on the unmodified stream, ranked by C_l^comp: `--no-input-fix`), compensated (the default: the mlp's input
side first, ln2(resid_pre) (I + W_in) + b_in fitted to ln2(resid_mid), then the output side on the input-fixed
block's defect), refit (--refit: the chosen blocks' fixes fitted again with all of them
in place). The drift-correcting refit measured here before (RESULTS) left the library with compensation.fit(drift=...);
the last commit holding both is 96f094c.

Windows as `surgery parallelize` deals them: 64 fit and 16 selection windows from the calibration part, and the
first 8 windows of the evaluation part held out; every number in the table is on the held-out windows. The PNG
plots held-out KL against the number of rewritten blocks: the prefixes, in the order the greedy kept them, of each
method's selection at the loosest budget.
"""

from __future__ import annotations

import argparse
import time

from common import smollm2, table

from surgery.compensation.fitting import FitSettings
from surgery.files import graph
from surgery.jobs.job import parallel_form
from surgery.jobs.select import PATIENCE, Budget, SelectionSettings, select_layers
from surgery.measure import scoring, statistics
from surgery.model.layers import format_layers
from surgery.report import numbers
from surgery.text import data

FITS = {"plain": None, "outputs": "full", "compensated": "full", "refit": "full", "drift": "full"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", default="0.02,0.05,0.1")
    parser.add_argument("--methods", default="plain,outputs,compensated,refit,drift")
    parser.add_argument("--max-loss-increase", default="none", help="the dNLL limit beside the KL one (none: KL alone)")
    parser.add_argument("--png", default=None)
    parser.add_argument("--fit-windows", type=int, default=64)
    parser.add_argument("--windows", type=int, default=16)
    args = parser.parse_args()
    folder = smollm2()
    model = graph.load(folder)
    cal = data.windows(folder, seq_len=256, max_windows=args.fit_windows + args.windows, part="calibration")
    fit_windows, sel = data.deal(cal, [args.fit_windows, args.windows], ["fit", "selection"])
    ev = data.windows(folder, seq_len=256, max_windows=8, part="evaluation")
    budgets = [float(b) for b in args.budgets.split(",")]
    rows, curves = [], {}
    for method in args.methods.split(","):
        for budget in budgets:
            start = time.perf_counter()
            fit = None if FITS[method] is None else FitSettings(kind=FITS[method], memory=None, input_fix=method != "outputs")
            greedy = SelectionSettings(Budget.parse(budget, args.max_loss_increase), patience=PATIENCE, refit=method == "refit")
            s = select_layers(model, sel, fit_windows=fit_windows, fit=fit, settings=greedy)
            fixes = s.fixes
            seconds = time.perf_counter() - start
            base, after = scoring.compare([model, parallel_form(model, s.layers, fixes=fixes).model], ev)
            kl, d = statistics.divergence(after), statistics.delta(base, after)
            rows.append({"method": method, "--max-kl": budget, "blocks": len(s.layers), "layers": format_layers(s.layers) or "-",
                         "KL [95 % CI]": str(kl), "KL p99": f"{kl.p99:.3f}", "top-1": f"{100 * kl.top1:.1f} %",
                         "dNLL [95 % CI]": numbers.dnll(d), "seconds": f"{seconds:.0f}"})
            print(rows[-1], flush=True)
            if budget == max(budgets) and args.png:
                order = [t.layer for t in s.trials if t.kept]
                curve = []
                for k in range(1, len(order) + 1):
                    prefix = order[:k]
                    sub = {l: f for l, f in fixes.items() if l in prefix}
                    curve.append(statistics.divergence(scoring.compare([model, parallel_form(model, prefix, fixes=sub).model], ev)[1]).kl)
                curves[method] = curve
                print(f"{method} @{budget}: held-out KL of each prefix, in the order kept: {[round(k, 4) for k in curve]}", flush=True)
    print(f"\nheld-out: {len(ev)} evaluation windows x 256 ({ev.tokens} tokens); dNLL limit {args.max_loss_increase}")
    print(table(rows, list(rows[0])))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for method, curve in curves.items():
            ax.plot(range(1, len(curve) + 1), curve, "o-", ms=3, label=method)
        ax.set_xlabel("rewritten blocks (in the order the greedy kept them)")
        ax.set_ylabel("held-out mean token KL (nats)")
        ax.set_title(f"SmolLM2-135M, --layers auto at --max-kl {max(budgets)}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
