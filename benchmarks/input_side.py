"""Does an mlp input side of the fix keep the same blocks closer to the original? SmolLM2-135M, fixed sets of blocks.

    python benchmarks/input_side.py [--sets "7,23-29;5-7,21-29"] [--eval-windows 8,64] [--input-windows 64,16]

The fixes of the union of the sets, fitted as `surgery parallelize` fits them (its 64 fit windows, dealt with its 16
selection windows from the calibration part): the output side alone (`--no-input-fix`, the fix before it) and the
input side first, then the output side on the input-fixed block's defect (the default). Every set is scored with
both against the original: KL [95 % CI], top-1 agreement and dNLL [95 % CI] on the selection windows, on the
*tuning* windows (the 27 calibration windows of the part's 107 that the main job's 80, evenly spaced, leave out),
and on N windows of the evaluation part, evenly spaced (8: the main job's held-out report; 64: eight times the
tokens). Also each layer's held-out residual fractions and C_l^comp with and without the input side.
--input-windows: the input side fitted on each of these numbers of the 64 fit windows, evenly spaced
(`compensation.fit(input_windows=...)`), the output side on all 64; --eval-windows "" scores no evaluation windows.
"""

from __future__ import annotations

import argparse
import time

from common import kl_score, main_job_windows, smollm2

from surgery import compensation, data, graph
from surgery.layers import parse_layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sets", default="7,23-29;5-7,21-29", help="sets of blocks, ';' between them")
    parser.add_argument("--eval-windows", default="8,64")
    parser.add_argument("--input-windows", default="64", help="fit the input side on each of these numbers of fit windows")
    args = parser.parse_args()
    folder = smollm2()
    model = graph.load(folder)
    sets = [sorted(parse_layers(s, 30)) for s in args.sets.split(";")]
    layers = sorted(set().union(*sets))
    fit_windows, selection, tuning = main_job_windows(folder)
    scored = {"selection": selection, "tuning": tuning}
    for n in (int(k) for k in args.eval_windows.split(",") if k):
        scored[f"evaluation {n}"] = data.windows(folder, seq_len=256, max_windows=n, part="evaluation")
    fixes = {}
    methods = [("output side", False, None)] + [
        (f"input side ({n} windows) + output side", True, n) for n in (int(k) for k in args.input_windows.split(","))]
    for name, side, count in methods:
        start, seconds = time.perf_counter(), {}
        fits = compensation.fit(model, fit_windows, set(layers), input_side=side, input_windows=count, seconds=seconds)
        fixes[name] = {l: fits[l].fix for l in layers}
        clock = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        print(f"{name}: fit {time.perf_counter() - start:.0f} s ({clock})", flush=True)
        for l in layers:
            extra = f", input side's residual {fits[l].input_residual:.4f}" if side else ""
            print(f"  block {l}: output side's held-out residual {fits[l].residual:.4f}, C_l^comp {fits[l].c_comp:.5f}{extra}", flush=True)
    for chosen in sets:
        for name, fix in fixes.items():
            for where, windows in scored.items():
                print(f"{chosen} {name}, {where} ({windows.tokens} tokens): {kl_score(model, chosen, {l: fix[l] for l in chosen}, windows)}",
                      flush=True)


if __name__ == "__main__":
    main()
