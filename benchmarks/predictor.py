"""One-pass predictors of the single-layer parallel dNLL: Spearman of each candidate score with the measured dNLL_l.

    python benchmarks/predictor.py [--windows 4] [--eval-windows 4] [--seq-len 256] [--model out/smollm2] [--split]

Scores come from the calibration windows (one probe pass), dNLL_l from the disjoint evaluation windows
(diagnose's switchboard). With delta = mlp(ln2 h) - mlp(ln2 x), y = resid_post, P_y the projection off y,
g the next normalisation's scale (the final norm's after the last block), token 0 left out:

    c            E|delta|^2 / E|mlp(ln2 h)|^2                (C_l)
    c_stream     E|delta|^2 / E|y|^2                        (C_l^stream)
    c_token      E[|delta|^2 / |y|^2]                       per token, then averaged
    c_tangent    E[|P_y delta|^2 / |y|^2]                   only what moves the direction the next norm reads
    c_next       E[|g * P_y delta|^2 / |y|^2] / mean(g^2)   ... weighted by the next norm's scale
    kl_linear    E[KL] to second order of logits moved by W_U (g_f * P_yL delta) sqrt(d) / |y_L|: delta carried
                 to the final norm unchanged (later blocks as identity), through it and the LM head linearised
                 (`--tokens` tokens of each window)
"""

from __future__ import annotations

import argparse

import numpy as np
from common import smollm2, table

from surgery import data, graph, nodes, runtime
from surgery.analysis import probe as probe_graph
from surgery.analysis import switchboard as board_graph
from surgery.blocks import block_norms, find_blocks
from surgery.diagnostics import diagnose
from surgery.diagnostics.rank import spearman

SCORES = ("c", "c_stream", "c_token", "c_tangent", "c_next", "kl_linear")


def next_scales(model, blocks) -> list[np.ndarray]:
    """The scale of the normalisation that reads each block's resid_post: the next block's ln1, or the final norm."""
    from surgery.blocks import _norm_nodes, _read_norm  # the final norm is not any block's ln

    values = nodes.values_by_name(model)
    scales = [np.asarray(values[block_norms(model, b)[0].scale].const_value.numpy(), np.float64) for b in blocks[1:]]
    last = values[blocks[-1].resid_post]
    node = next(n for n in _norm_nodes(last))
    scales.append(np.asarray(values[_read_norm(node, last, len(blocks), "final norm").scale].const_value.numpy(), np.float64))
    return scales


def lm_head(logits) -> np.ndarray:
    """The [d, vocab] weight of MatMul(final norm, W) producing the logits (W maybe Transpose(embedding): tied)."""
    weight = logits.producer().inputs[1]
    producer = weight.producer()
    if producer is not None and producer.op_type == "Transpose":
        return np.ascontiguousarray(producer.inputs[0].const_value.numpy().T, np.float32)
    return weight.const_value.numpy().astype(np.float32)


def candidate_scores(path, windows, tokens: int) -> dict[str, list[float]]:
    model = graph.load(path)
    blocks = find_blocks(model)
    g = next_scales(model, blocks)
    head = lm_head(nodes.values_by_name(model)["logits"])
    p = probe_graph.probe(model, tensors=("mlp_out", "resid_post"), twin=True)
    sess = runtime.session(p.model)
    names = [o.name for o in sess.get_outputs()]
    n = len(blocks)
    sums = {k: np.zeros(n) for k in ("dd", "hh", "yy", "token", "tangent", "next", "count", "kl", "kl_count")}
    rng = np.random.default_rng(0)
    for i in range(len(windows)):
        out = dict(zip(names, sess.run(None, runtime.feeds(sess, windows.ids[i : i + 1]))))
        picks = np.sort(rng.choice(windows.ids.shape[1] - 1, size=min(tokens, windows.ids.shape[1] - 1), replace=False))
        y_last = out[p.outputs[-1]["resid_post"]][0, 1:][picks].astype(np.float64)
        unit_last = y_last / np.linalg.norm(y_last, axis=-1, keepdims=True)
        gain = np.sqrt(y_last.shape[1]) / np.linalg.norm(y_last, axis=-1, keepdims=True)
        logits = out["logits"][0, 1:][picks].astype(np.float64)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
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
            moved = delta[picks] - np.sum(delta[picks] * unit_last, axis=-1, keepdims=True) * unit_last
            shift = ((g[-1] * moved * gain).astype(np.float32) @ head).astype(np.float64)  # [tokens, vocab]
            mean = np.sum(probs * shift, axis=-1)
            sums["kl"][layer] += 0.5 * np.sum(np.sum(probs * shift**2, axis=-1) - mean**2)
            sums["kl_count"][layer] += len(picks)
    c = sums["count"]
    return {
        "c": list(sums["dd"] / sums["hh"]), "c_stream": list(sums["dd"] / sums["yy"]), "c_token": list(sums["token"] / c),
        "c_tangent": list(sums["tangent"] / c), "c_next": list(sums["next"] / c), "kl_linear": list(sums["kl"] / sums["kl_count"]),
    }


def split_dnll(path, windows) -> tuple[list[float], list[float]]:
    """Single-layer parallel dNLL_l on the first and on the second half of `windows`, from one switchboard session."""
    from surgery import evaluate

    model = graph.load(path)
    n = len(find_blocks(model))
    kinds = [("parallelize",)]
    scorer = evaluate.Scorer(board_graph.switchboard(model, kinds))
    runs = [scorer(windows, extra={board_graph.SWITCHES: board_graph.switches(kinds, n, on)}) for on in [{}] + [{kinds[0]: {l}} for l in range(n)]]
    half = len(windows) // 2

    def dnll(run, part):
        return sum(run.window_nll[part]) / sum(run.window_tokens[part]) - sum(runs[0].window_nll[part]) / sum(runs[0].window_tokens[part])

    first, second = slice(0, half), slice(half, None)
    return [dnll(r, first) for r in runs[1:]], [dnll(r, second) for r in runs[1:]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--eval-windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per window for kl_linear")
    parser.add_argument("--split", action="store_true", help="dNLL_l on two disjoint sets of --eval-windows windows: the noise ceiling")
    args = parser.parse_args()
    path = args.model or smollm2()
    cal = data.windows(path, seq_len=args.seq_len, max_windows=args.windows, part="calibration")
    scores = candidate_scores(path, cal, args.tokens)
    if args.split:  # how well dNLL_l on one set of evaluation windows ranks dNLL_l on another: the ceiling for any score
        ev = data.windows(path, seq_len=args.seq_len, max_windows=2 * args.eval_windows, part="evaluation")
        a, b = split_dnll(path, ev)
        rows = [{"ranking": "dNLL_l, windows 1-4 vs 5-8", "Spearman": f"{spearman(a, b):+.3f}"}]
        rows += [{"ranking": f"{k} vs dNLL_l on windows {w}", "Spearman": f"{spearman(scores[k], d):+.3f}"} for k in SCORES for w, d in (("1-4", a), ("5-8", b))]
        print(table(rows, list(rows[0])))
        return
    report = diagnose(path, seq_len=args.seq_len, windows=1, eval_windows=args.eval_windows, only=("defect",)).to_json()
    dnll = report["defect"]["dnll_parallel"]
    rows = [{"score": k, "Spearman with dNLL_l": f"{spearman(scores[k], dnll):+.3f}"} for k in SCORES]
    print(f"{path}: {len(dnll)} layers, scores on {len(cal)} calibration windows, dNLL on {args.eval_windows} evaluation windows x {args.seq_len}")
    print(table(rows, list(rows[0])))
    per_layer = [{"layer": str(l), "dNLL_l": f"{dnll[l]:+.4f}", **{k: f"{scores[k][l]:.3g}" for k in SCORES}} for l in range(len(dnll))]
    print(table(per_layer, list(per_layer[0])))


if __name__ == "__main__":
    main()
