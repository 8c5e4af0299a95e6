"""The headline: SmolLM2-135M original vs auto-parallel (plain, fused, calibrated), quality and speed.

    python benchmarks/parallelize.py [--repeats 20] [--all-layers] [--variants "plain all 30,fused all 30"]
                                     [--device auto] [--execution sequential|parallel] [--threads N]

One selection (defaults: C_l^stream ranking, 0.02 nats on 4 calibration windows), then every
variant's dNLL on 8 held-out evaluation windows, graph size, the paper's estimated speedup, and
prefill / decode latency from ONE interleaved run of all variants (same session options).
"""

from __future__ import annotations

import argparse
from collections import Counter

from common import smollm2, table

from surgery import data, evaluate, graph, runtime
from surgery.layers import format_layers
from surgery.select import rewrite, select_layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--execution", default="sequential", choices=["sequential", "parallel"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--all-layers", action="store_true", help="also time every block made parallel")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the variant names to time")
    args = parser.parse_args()
    options = runtime.Options(threads=args.threads, execution=args.execution, device=args.device)

    folder = smollm2()
    model = graph.load(folder)
    cal = data.windows(folder, seq_len=args.seq_len, max_windows=4, part="calibration")
    ev = data.windows(folder, seq_len=args.seq_len, max_windows=8, part="evaluation")
    selection = select_layers(model, cal, options=options)
    layers = selection.layers
    alpha = {l: selection.alpha[l] for l in layers}
    variants = {
        "original": model,
        "plain": rewrite(model, layers).model,
        "fused": rewrite(model, layers, fused=True).model,
        "calibrated": rewrite(model, layers, alpha=alpha).model,
        "fused calibrated": rewrite(model, layers, fused=True, alpha=alpha).model,
    }
    if args.all_layers:
        every = range(30)
        variants["plain all 30"] = rewrite(model, every).model
        variants["fused all 30"] = rewrite(model, every, fused=True).model

    if args.variants:
        keep = {v.strip() for v in args.variants.split(",")} | {"original"}
        variants = {k: v for k, v in variants.items() if k in keep}

    base = evaluate.perplexity(model, ev, options=options).loss
    times = evaluate.branch_times(model, seq_len=args.seq_len)
    timed = evaluate.latency(list(variants.values()), batch=args.batch, seq_len=args.seq_len, repeats=args.repeats, options=options)
    rows = []
    for (name, m), t in zip(variants.items(), timed):
        ops = Counter(n.op_type for n in m.graph)
        chosen = range(30) if "all 30" in name else layers
        rows.append({
            "graph": name,
            "dNLL eval": "0" if name == "original" else f"{evaluate.perplexity(m, ev, options=options).loss - base:+.4f}",
            "nodes": str(len(m.graph)),
            "MatMul": str(ops["MatMul"]),
            "norms": str(ops["ReduceMean"] // 1 + ops["LayerNormalization"]),
            "est. speedup": "1" if name == "original" else f"{times.estimated_speedup(chosen):.3f}",
            "prefill ms": f"{t.prefill_ms:.1f}",
            "prefill x": f"{timed[0].prefill_ms / t.prefill_ms:.3f}",
            "decode ms": f"{t.decode_ms:.2f}",
            "decode x": f"{timed[0].decode_ms / t.decode_ms:.3f}",
        })
    print(f"chosen layers {format_layers(layers)} ({len(layers)} blocks), dNLL calibration {selection.dnll:+.4f}, "
          f"{selection.forward_passes} forward passes; base loss {base:.4f} on {ev.tokens} evaluation tokens")
    print(f"{timed[0].provider}, batch {args.batch}, prefill {args.seq_len}, decode 1 after {args.seq_len}, "
          f"{args.repeats} interleaved repeats, execution {args.execution}, threads {args.threads or 'ORT default'}")
    print(table(rows, list(rows[0])))
    print("\nx = original median / this graph's median (> 1 is faster); est. speedup = the paper's max(t_attn, t_mlp) "
          "estimate from per-branch kernel times of the original graph; norms = ReduceMean + LayerNormalization nodes")


if __name__ == "__main__":
    main()
