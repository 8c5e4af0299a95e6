"""Latency of the original SmolLM2-135M graph vs parallelized ones, from one interleaved run.

    python benchmarks/latency.py [--layers 5,22,25] [--seq-len 256] [--repeats 30]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import smollm2, table

from surgery import evaluate, graph, runtime
from surgery.blocks import find_blocks
from surgery.layers import parse_layers
from surgery.passes import parallelize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="5,22,25")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--execution", default="sequential", choices=["sequential", "parallel"])
    args = parser.parse_args()

    folder = smollm2()
    model = graph.load(folder)
    n = len(find_blocks(model))
    variants = {"original": folder}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in (args.layers, "all"):
            layers = parse_layers(spec, n)
            out = Path(tmp) / f"parallel-{spec}"
            graph.write(parallelize(model, layers).model, out, like=folder)
            variants[f"parallel {spec} ({len(layers)} blocks)"] = out
        options = runtime.Options(threads=args.threads, execution=args.execution)
        results = evaluate.latency(list(variants.values()), batch=args.batch, seq_len=args.seq_len, repeats=args.repeats, options=options)
    base = results[0]
    rows = []
    for name, r in zip(variants, results):
        rows.append({
            "graph": name,
            "prefill ms (p90)": f"{r.prefill_ms:.1f} ({r.prefill_p90_ms:.1f})",
            "decode ms/token (p90)": f"{r.decode_ms:.2f} ({r.decode_p90_ms:.2f})",
            "prefill ratio": f"{base.prefill_ms / r.prefill_ms:.3f}",
            "decode ratio": f"{base.decode_ms / r.decode_ms:.3f}",
            "prefill / decode": f"{r.prefill_ms / r.decode_ms:.1f}",
        })
    print(f"{results[0].provider}, batch {args.batch}, prefill {args.seq_len} tokens, decode 1 token after a cache of {args.seq_len}, "
          f"{args.repeats} interleaved repeats, execution {args.execution}, threads {args.threads or 'ORT default'}")
    print(table(rows, list(rows[0])))
    print("\nratio = original median / this graph's median (> 1 is faster)")


if __name__ == "__main__":
    main()
