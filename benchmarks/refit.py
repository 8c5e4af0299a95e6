"""Are fixes fitted on the unmodified stream worse than fixes fitted on the stream they will see? SmolLM2-135M,
one fixed set of blocks.

    python benchmarks/refit.py [--layers 5-7,21-29]

The blocks' fixes (both sides, the main job's 64 fit windows) fitted three ways: independently, each on the
unmodified stream (the default); refitted once with every chosen block compensated in place (`--refit`: one more
pass, each block keeps its input side, the output side is fitted again; a Jacobi step); and refitted in layer order,
each block's input and output side on the stream of the model whose earlier chosen blocks already carry their
refitted fixes (Gauss-Seidel: two passes per block here). Each is scored against the original on the selection
windows, the 27 tuning windows (the calibration windows the main job leaves out) and 64 evaluation windows.
"""

from __future__ import annotations

import argparse
import time

from common import kl_score, main_job_windows, smollm2

from surgery import compensation, data, graph
from surgery.compensation import KINDS
from surgery.layers import parse_layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="5-7,21-29")
    args = parser.parse_args()
    folder = smollm2()
    model = graph.load(folder)
    chosen = sorted(parse_layers(args.layers, 30))
    fit_windows, selection, tuning = main_job_windows(folder)
    scored = {"selection": selection, "tuning": tuning,
              "eval 64": data.windows(folder, seq_len=256, max_windows=64, part="evaluation")}
    variants = {}
    start = time.perf_counter()
    fits = compensation.fit(model, fit_windows, set(chosen))
    variants["independent"] = {l: fits[l].fix for l in chosen}
    print(f"independent fit {time.perf_counter() - start:.0f} s", flush=True)
    start = time.perf_counter()
    on = {KINDS[0]: set(chosen), KINDS[1]: set(chosen)}
    again = compensation.fit(model, fit_windows, set(chosen), fixes=variants["independent"], on=on, input_side=False)
    variants["refit (jacobi)"] = {l: again[l].fix for l in chosen}
    print(f"jacobi refit {time.perf_counter() - start:.0f} s", flush=True)
    start = time.perf_counter()
    seq = dict(variants["independent"])
    for layer in chosen[1:]:
        before = {l for l in chosen if l < layer}
        seq[layer] = compensation.fit(model, fit_windows, {layer}, fixes=seq, on={KINDS[0]: before, KINDS[1]: before})[layer].fix
    variants["sequential, both sides refitted"] = seq
    print(f"sequential refit {time.perf_counter() - start:.0f} s", flush=True)
    for name, fixes in variants.items():
        for where, windows in scored.items():
            print(f"{name}, {where}: {kl_score(model, chosen, fixes, windows)}", flush=True)


if __name__ == "__main__":
    main()
