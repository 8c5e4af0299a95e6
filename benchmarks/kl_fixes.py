"""Which fit keeps a chosen set of compensated blocks closest to the original? SmolLM2-135M, one fixed set of blocks.

    python benchmarks/kl_fixes.py --layers 6-8,22-23,25,28-29 [--what fits,drift]

`fits`: the same blocks with fixes fitted on 32 fit windows with the ridge grid up to 1 (the grid before issue 18),
up to 100, and on 75 fit windows; and plain (no fix). Scored on 32 *tuning* windows: calibration windows 40..71 of
the part's 107 (evenly spaced), disjoint from these fit windows and from the evaluation part that reports use.
`drift`: the fixes fitted to each block's own defect on the unmodified stream (32 fit windows, the first 40 windows
of the same list dealt into 32 fit and 8 selection windows), against the drift-correcting fit refitted in layer order
(each block on the stream of the model whose earlier chosen blocks are already rewritten, aimed at the original
model's resid_post; one fit pass per block), scored on those 8 selection windows and on the first 16 windows of the
evaluation part.
"""

from __future__ import annotations

import argparse
import time

from common import drift_refit, kl_score, smollm2

from surgery import compensation, data, graph
from surgery.layers import parse_layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="6-8,22-23,25,28-29")
    parser.add_argument("--what", default="fits,drift")
    args = parser.parse_args()
    folder = smollm2()
    model = graph.load(folder)
    layers = sorted(parse_layers(args.layers, 30))
    cal = data.windows(folder, seq_len=256, max_windows=107, part="calibration")
    fit_windows, selection = data.deal(cal.take(range(40)), [32, 8], ["fit", "selection"])
    if "fits" in args.what:
        tuning = cal.take(range(40, 72))
        more = cal.take(list(range(40)) + list(range(72, 107)))  # 75 windows, none of them a tuning window
        grid = compensation.RIDGES + (10.0, 30.0, 100.0)
        old_grid = (1e-8, 1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
        for name, windows, ridges in (("32 fit windows, ridges to 1", fit_windows, old_grid),
                                      ("32 fit windows, ridges to 100", fit_windows, grid),
                                      ("75 fit windows, ridges to 100", more, grid)):
            start = time.perf_counter()
            fits = compensation.fit(model, windows, set(layers), ridges=ridges)
            print(f"{name}: ridges {[fits[l].ridge for l in layers]}, held-out residual {[round(fits[l].residual, 3) for l in layers]}, "
                  f"fit {time.perf_counter() - start:.0f} s", flush=True)
            print(f"  tuning windows: {kl_score(model, layers, {l: fits[l].fix for l in layers}, tuning)}", flush=True)
        print(f"plain: tuning windows: {kl_score(model, layers, {}, tuning)}", flush=True)
    if "drift" in args.what:
        evaluation = data.windows(folder, seq_len=256, max_windows=16, part="evaluation")
        stream: dict = {}
        fits = compensation.fit(model, fit_windows, keep_stream=stream)
        own = {l: fits[l].fix for l in layers}
        print(f"own defect: selection {kl_score(model, layers, own, selection)}; evaluation {kl_score(model, layers, own, evaluation)}", flush=True)
        drift = drift_refit(model, fit_windows, layers, own, stream)
        print(f"drift-correcting, in layer order: selection {kl_score(model, layers, drift, selection)}; "
              f"evaluation {kl_score(model, layers, drift, evaluation)}", flush=True)


if __name__ == "__main__":
    main()
