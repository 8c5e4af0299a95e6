"""Do the model's own samples (half the default corpus) come out the same under float noise? For each drawing rule
(corpus.RULES: `gumbel`, the default, and `inverse`, the rule before) and each pair of runs that agree but for float
noise, the windows whose tokens differ and the first position where each does.

    python benchmarks/samples.py [--rows 40] [--seq-len 256] [--rules gumbel,inverse]

Pairs, each drawing the same rows with the same seeds (seed 1, the main job's calibration part's) on SmolLM2-135M:
    threads 1 / 2              ONNX Runtime with one intra-op thread against two
    optimization all / basic   ORT's graph optimizations `all` against `basic` (other fusions: float32 values a few ulps apart)
    batch rows / 1             the rows drawn together against one at a time (other GEMM shapes)
    fp32 / fp16                the fp32 export against its fp16 export (`surgery export --dtype fp16`): not noise, a check
                               that the comparison sees a real difference
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import ROOT, smollm2, table

from surgery.engine import runtime
from surgery.files import graph
from surgery.text import corpus, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rules", default=",".join(corpus.RULES))
    args = parser.parse_args()
    folder = smollm2()
    fp16 = ROOT / "out" / "smollm2-fp16"
    if not (fp16 / "model.onnx").is_file():
        from surgery.files.export import export

        export("smollm2-135m", fp16, dtype="fp16")
    model, half = graph.load(folder), graph.load(fp16)
    prefix = data.bos_prefix(data.load_tokenizer(folder))
    rows = []
    for rule in args.rules.split(","):
        start = time.perf_counter()

        def draw(options, of=model, alone=False):
            if alone:
                return np.concatenate([corpus.samples(of, 1, args.seq_len, prefix, 1, options, rule, first=r) for r in range(args.rows)])
            return corpus.samples(of, args.rows, args.seq_len, prefix, 1, options, rule)

        base = draw(runtime.Options(threads=2))
        pairs = {"threads 1 / 2": draw(runtime.Options(threads=1)),
                 "optimization all / basic": draw(runtime.Options(threads=2, optimization="basic")),
                 "batch rows / 1": draw(runtime.Options(threads=2), alone=True),
                 "fp32 / fp16": draw(runtime.Options(threads=2), of=half)}
        for name, other in pairs.items():
            first = sorted(int(np.flatnonzero(x != y)[0]) for x, y in zip(base, other) if (x != y).any())
            rows.append({"rule": rule, "pair": name, "windows": args.rows,
                         "tokens drawn": args.rows * (args.seq_len - len(prefix)), "windows that differ": len(first),
                         "first differing positions": ", ".join(map(str, first)) or "-"})
        print(f"{rule}: {time.perf_counter() - start:.0f} s", flush=True)
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
