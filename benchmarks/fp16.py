"""fp16 vs fp32 SmolLM2-135M: the same rewrites on both exports, loss on the same windows.

    python benchmarks/fp16.py [--windows 8] [--seq-len 128] [--layers 5,22,25]

Exports `surgery export smollm2-135m --dtype fp16` to out/smollm2-fp16 on first use (the fp32 one
to out/smollm2, as every script does) and prints one markdown table: per rewrite, the loss of each
graph, their difference (fp16 - fp32), and each graph's dNLL against its own unrewritten export.
"""

from __future__ import annotations

import argparse

from common import ROOT, smollm2, table

from surgery import data, evaluate, graph
from surgery.layers import parse_layers
from surgery.passes import ablate, fuse, parallelize

SMOLLM2_FP16 = ROOT / "out" / "smollm2-fp16"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", default="5,22,25")
    args = parser.parse_args()

    fp32 = smollm2()
    if not (SMOLLM2_FP16 / "model.onnx").is_file():
        from surgery.export import export

        export("smollm2-135m", SMOLLM2_FP16, dtype="fp16")
    models = {"fp32": graph.load(fp32), "fp16": graph.load(SMOLLM2_FP16)}
    layers = parse_layers(args.layers, 30)
    rewrites = {
        "none": lambda m: m,
        "parallel": lambda m: parallelize(m, layers).model,
        "parallel, fused": lambda m: fuse(m, layers).model,
        "parallel + mlp tangential": lambda m: ablate(parallelize(m, layers).model, "mlp", "tangential", layers).model,
        "mlp radial": lambda m: ablate(m, "mlp", "radial", layers).model,
        "mlp remove": lambda m: ablate(m, "mlp", "remove", layers).model,
        "attn tangential": lambda m: ablate(m, "attn", "tangential", layers).model,
        "attn scale 0.5": lambda m: ablate(m, "attn", "scale", layers, 0.5).model,
    }
    windows = data.windows(fp32, seq_len=args.seq_len, max_windows=args.windows)
    rows, base = [], {}
    for name, rewrite in rewrites.items():
        loss = {dtype: evaluate.perplexity(rewrite(m), windows).loss for dtype, m in models.items()}
        base = base or loss
        rows.append({
            "rewrite": name, "fp32 loss": f"{loss['fp32']:.5f}", "fp16 loss": f"{loss['fp16']:.5f}",
            "fp16 - fp32": f"{loss['fp16'] - loss['fp32']:+.5f}",
            "dNLL fp32": f"{loss['fp32'] - base['fp32']:+.5f}", "dNLL fp16": f"{loss['fp16'] - base['fp16']:+.5f}",
        })
    print(f"layers {args.layers}; {len(windows)} evaluation windows x {args.seq_len} tokens\n")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
