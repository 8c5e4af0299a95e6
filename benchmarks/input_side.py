"""Does an mlp input side of the fix keep the same blocks closer to the original? SmolLM2-135M, fixed sets of blocks.

    python benchmarks/input_side.py [--sets "7,23-29;5-7,21-29"] [--eval-windows 8,64]

The fixes of the union of the sets, fitted as `surgery parallelize` fits them (its 64 fit windows, dealt with its 16
selection windows from the calibration part): the output side alone (`--no-input-fix`, the fix before it) and the
input side first, then the output side on the input-fixed block's defect (the default). Every set is scored with
both against the original: KL [95 % CI], top-1 agreement and dNLL [95 % CI] on the selection windows, on the
*tuning* windows (the 27 calibration windows of the part's 107 that the main job's 80, evenly spaced, leave out),
and on N windows of the evaluation part, evenly spaced (8: the main job's held-out report; 64: eight times the
tokens). Also each layer's held-out residual fractions and C_l^comp with and without the input side.
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
    args = parser.parse_args()
    folder = smollm2()
    model = graph.load(folder)
    sets = [sorted(parse_layers(s, 30)) for s in args.sets.split(";")]
    layers = sorted(set().union(*sets))
    fit_windows, selection, tuning = main_job_windows(folder)
    scored = {"selection": selection, "tuning": tuning}
    for n in (int(k) for k in args.eval_windows.split(",")):
        scored[f"evaluation {n}"] = data.windows(folder, seq_len=256, max_windows=n, part="evaluation")
    fixes = {}
    for name, side in (("output side", False), ("input + output side", True)):
        start = time.perf_counter()
        fits = compensation.fit(model, fit_windows, set(layers), input_side=side)
        fixes[name] = {l: fits[l].fix for l in layers}
        print(f"{name}: fit {time.perf_counter() - start:.0f} s", flush=True)
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
