"""The compensation fit alone: its passes and where its time goes, with the fixes saved for comparing two versions.

    python graphs/big_decoder.py out/big4 --layers 4
    python benchmarks/fit_passes.py out/big4 --windows 16 --fit-memory 403M --save out/fits-new.npz
    git stash / checkout another version, run it again with --save out/fits-old.npz, then
    python benchmarks/fit_passes.py --compare out/fits-old.npz out/fits-new.npz

--fit-memory 403M holds one d_model 2048 layer's normal equations: one pass per layer.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import common  # noqa: F401  (puts the repository on sys.path)


def run(model_path: str, windows: int, fit_memory: str, save: str | None) -> None:
    from surgery import compensation, data, graph

    model = graph.load(model_path)
    fit_windows = data.windows(model_path, seq_len=256, max_windows=windows, part="calibration")
    bound = compensation.memory_bound(fit_memory)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    fits = compensation.fit(model, fit_windows, memory_bytes=bound, seconds=seconds)
    total = time.perf_counter() - start
    passes = compensation.passes(model, memory_bytes=bound)
    print(f"{passes} passes over {windows} windows: {total:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()) + ")")
    if save:
        arrays = {}
        for layer, r in fits.items():
            arrays[f"{layer}/ridge"] = np.array(r.ridge)
            for part in ("w_a", "w_p", "b"):
                arrays[f"{layer}/{part}"] = np.asarray(getattr(r.fix, part))
        np.savez(save, **arrays)


def compare(a: str, b: str) -> None:
    x, y = np.load(a), np.load(b)
    ridges = all(x[k] == y[k] for k in x.files if k.endswith("/ridge"))
    worst = max(float(np.abs(x[k] - y[k]).max() / np.abs(x[k]).max()) for k in x.files if not k.endswith("/ridge"))
    print(f"ridges equal: {ridges}; largest relative difference of the fixes: {worst:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--fit-memory", default="auto")
    parser.add_argument("--save")
    parser.add_argument("--compare", nargs=2, metavar=("A.npz", "B.npz"))
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args.model, args.windows, args.fit_memory, args.save)


if __name__ == "__main__":
    main()
