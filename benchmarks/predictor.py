"""One-pass predictors of the single-layer parallel dNLL: Spearman of each candidate score with the measured dNLL_l.

    python benchmarks/predictor.py [--windows 4] [--eval-windows 4] [--seq-len 256] [--model out/smollm2]

Scores come from the calibration windows (one probe pass), dNLL_l from the disjoint evaluation windows
(diagnose's switchboard). With delta = mlp(ln2 h) - mlp(ln2 x), y = resid_post, P_y the projection off y,
g the next normalisation's scale (the final norm's after the last block), token 0 left out:

    c            E|delta|^2 / E|mlp(ln2 h)|^2                (C_l)
    c_stream     E|delta|^2 / E|y|^2                        (C_l^stream)
    c_token      E[|delta|^2 / |y|^2]                       per token, then averaged
    c_tangent    E[|P_y delta|^2 / |y|^2]                   only what moves the direction the next norm reads
    c_next       E[|g * P_y delta|^2 / |y|^2] / mean(g^2)   ... weighted by the next norm's scale
"""

from __future__ import annotations

import argparse

from common import smollm2, table

import numpy as np

from surgery import data, graph, runtime
from surgery.blocks import block_norms, find_blocks
from surgery.diagnostics import diagnose, graphs
from surgery.diagnostics.defect import spearman

SCORES = ("c", "c_stream", "c_token", "c_tangent", "c_next")


def next_scales(model, blocks) -> list[np.ndarray]:
    """The scale of the normalisation that reads each block's resid_post: the next block's ln1, or the final norm."""
    from surgery.blocks import _norm_nodes, _read_norm  # the final norm is not any block's ln

    values = graph.values_by_name(model)
    scales = [np.asarray(values[block_norms(model, b)[0].scale].const_value.numpy(), np.float64) for b in blocks[1:]]
    last = values[blocks[-1].resid_post]
    node = next(n for n in _norm_nodes(last))
    scales.append(np.asarray(values[_read_norm(node, last, len(blocks), "final norm").scale].const_value.numpy(), np.float64))
    return scales


def candidate_scores(path, windows) -> dict[str, list[float]]:
    model = graph.load(path)
    blocks = find_blocks(model)
    g = next_scales(model, blocks)
    p = graphs.probe(model, tensors=("mlp_out", "resid_post"), twin=True)
    sess = runtime.session(p.model)
    names = [o.name for o in sess.get_outputs()]
    n = len(blocks)
    sums = {k: np.zeros(n) for k in ("dd", "hh", "yy", "token", "tangent", "next", "count")}
    for i in range(len(windows)):
        out = dict(zip(names, sess.run(None, runtime.feeds(sess, windows.ids[i : i + 1]))))
        for layer, o in enumerate(p.outputs):
            h, x, y = (out[o[k]][0, 1:].astype(np.float64) for k in ("mlp_out", "mlp_out_on_pre", "resid_post"))
            delta = h - x
            y2 = np.sum(y * y, axis=-1)
            along = np.sum(delta * y, axis=-1, keepdims=True) / y2[:, None] * y
            tangent = delta - along
            sums["dd"][layer] += np.sum(delta**2)
            sums["hh"][layer] += np.sum(h**2)
            sums["yy"][layer] += np.sum(y2)
            sums["token"][layer] += np.sum(np.sum(delta**2, axis=-1) / y2)
            sums["tangent"][layer] += np.sum(np.sum(tangent**2, axis=-1) / y2)
            sums["next"][layer] += np.sum(np.sum((g[layer] * tangent) ** 2, axis=-1) / y2) / np.mean(g[layer] ** 2)
            sums["count"][layer] += len(y)
    c = sums["count"]
    return {
        "c": list(sums["dd"] / sums["hh"]), "c_stream": list(sums["dd"] / sums["yy"]), "c_token": list(sums["token"] / c),
        "c_tangent": list(sums["tangent"] / c), "c_next": list(sums["next"] / c),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--eval-windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    path = args.model or smollm2()
    cal = data.windows(path, seq_len=args.seq_len, max_windows=args.windows, part="calibration")
    scores = candidate_scores(path, cal)
    report = diagnose(path, seq_len=args.seq_len, windows=1, eval_windows=args.eval_windows, only=("defect",))
    dnll = report["defect"]["dnll_parallel"]
    rows = [{"score": k, "Spearman with dNLL_l": f"{spearman(scores[k], dnll):+.3f}"} for k in SCORES]
    print(f"{path}: {len(dnll)} layers, scores on {len(cal)} calibration windows, dNLL on {args.eval_windows} evaluation windows x {args.seq_len}")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
