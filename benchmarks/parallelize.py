"""The headline: SmolLM2-135M original vs auto-parallel, plain / alpha-calibrated / compensated / compensated + fused.

    python benchmarks/parallelize.py [--budgets 0.02,0.05] [--repeats 20] [--seq-len 256] [--fit-windows 32] [--windows 8]
                                     [--eval-windows 8] [--all-layers] [--device auto] [--threads N]

Calibration windows are dealt into fit windows (the fixes) and selection windows (the greedy
dNLL checks), as `surgery parallelize` does; each (fit, budget) pair runs its own selection on
them. Every variant's dNLL is measured on the disjoint evaluation windows with a 95 % paired
bootstrap interval; prefill / decode latency of all variants comes from ONE interleaved run
(same session options). --all-layers adds every block parallel (plain, fused, compensated).
"""

from __future__ import annotations

import argparse
import time

from common import smollm2, table

from surgery.compensation.fitting import FitSettings
from surgery.engine import runtime
from surgery.files import graph
from surgery.jobs.job import parallel_form
from surgery.jobs.select import Budget, SelectionSettings, select_layers
from surgery.measure import scoring, statistics, timing
from surgery.model.layers import format_layers
from surgery.report import numbers
from surgery.text import data

FITS = {"plain": None, "calibrated": "gate", "compensated": "full"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", default="0.02,0.05")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--fit-windows", type=int, default=32)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--all-layers", action="store_true", help="also every block parallel")
    args = parser.parse_args()
    options = runtime.Options(threads=args.threads, device=args.device)

    folder = smollm2()
    model = graph.load(folder)
    cal = data.windows(folder, seq_len=args.seq_len, max_windows=args.fit_windows + args.windows, part="calibration")
    fit_windows, sel = data.deal(cal, [args.fit_windows, args.windows], ["fit", "selection"])
    ev = data.windows(folder, seq_len=args.seq_len, max_windows=args.eval_windows, part="evaluation")
    variants = {"original": (model, None, ())}
    for budget in (float(b) for b in args.budgets.split(",")):
        for name, fit in FITS.items():
            fitted = None if fit is None else FitSettings(kind=fit, memory=None)
            s = select_layers(model, sel, fit_windows=fit_windows, fit=fitted, settings=SelectionSettings(Budget(None, budget)), options=options)
            variants[f"{name} @{budget}"] = (parallel_form(model, s.layers, fixes=s.fixes).model, s, s.layers)
            if fit == "full":
                variants[f"compensated + fused @{budget}"] = (parallel_form(model, s.layers, fused=True, fixes=s.fixes).model, s, s.layers)
            print(f"{name} @{budget}: {format_layers(s.layers) or 'none'} ({len(s.layers)}), selection dNLL {numbers.dnll(s.dnll)}, "
                  f"{s.forward_passes} selection passes, seconds {s.seconds}", flush=True)
    if args.all_layers:
        from surgery.compensation.fitting import fit as fit_all

        fits = fit_all(model, fit_windows, options=options)
        every = range(len(fits))
        variants["plain all"] = (parallel_form(model, every).model, None, tuple(every))
        variants["compensated all"] = (parallel_form(model, every, fixes={l: f.fix for l, f in fits.items() if f.fix}).model, None, tuple(every))

    base = scoring.perplexity(model, ev, options=options)
    times = timing.branch_times(model, seq_len=args.seq_len)
    start = time.perf_counter()
    timed = timing.latency([m for m, _, _ in variants.values()], seq_len=args.seq_len, repeats=args.repeats, options=options)
    latency_s = time.perf_counter() - start
    rows = []
    for (name, (m, s, layers)), t in zip(variants.items(), timed):
        d = None if name == "original" else statistics.delta(base, scoring.perplexity(m, ev, options=options))
        rows.append({
            "graph": name,
            "blocks": str(len(layers)),
            "layers": format_layers(layers) or "-",
            "dNLL selection": "-" if s is None else f"{s.dnll.dnll:+.4f}",
            "dNLL eval [95 % CI]": "0" if d is None else numbers.dnll(d),
            "est. speedup": f"{times.estimated_speedup(layers):.3f}",
            "prefill x": f"{timed[0].prefill_ms / t.prefill_ms:.3f}",
            "decode x": f"{timed[0].decode_ms / t.decode_ms:.3f}",
            "fit s": "-" if s is None or "fit" not in s.seconds else f"{s.seconds['fit']:.0f}",
            "selection s": "-" if s is None else f"{s.seconds['selection']:.0f}",
        })
    print(f"\nbase loss {base.loss:.4f} on {ev.tokens} evaluation tokens; fit {len(fit_windows)} x {args.seq_len}, "
          f"selection {len(sel)} x {args.seq_len} windows (disjoint); {timed[0].provider}, prefill {args.seq_len}, "
          f"decode 1 after {args.seq_len}, {args.repeats} interleaved repeats ({latency_s:.0f} s)")
    print(table(rows, list(rows[0])))
    print("\nx = original median / this graph's median (> 1 is faster); est. speedup = the paper's max(t_attn, t_mlp) "
          "estimate from per-branch kernel times of the original graph")


if __name__ == "__main__":
    main()
