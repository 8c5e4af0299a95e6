"""Per-window statistics of the probe's block tensors, computed inside the graph by ONNX Runtime.

Only per-layer sums leave the session (in float64, token 0 left out), instead of every block's
[pos, d_model] tensors for NumPy to reduce:

    align         sum_i cos(P_u A, P_u (y - x)), u = x / |x|           (angular deficit)
    sum_u.P       |sum_i u_i|^2 at P in pre / mid / post                 (mean pairwise cosine)
    gram.P        U U^T of the directions at P                            (effective rank: its eigenvalues)
    defect        [|h - x|^2, |h|^2, |y|^2, <h, x>, |x|^2] summed, h = mlp(ln2 resid_mid), x = mlp(ln2 resid_pre)
    field_norm    |input of the mlp field| per token                      (the critical points' radius)

geometry.py holds the same quantities in NumPy, the reference these are tested against.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from threadpoolctl import threadpool_limits

from surgery.model.nodes import Emitter

POINTS = {"pre": "resid_pre", "mid": "resid_mid", "post": "resid_post"}
_TINY = 1e-30


def name(layer: int, what: str) -> str:
    return f"surgery/stats/blocks.{layer}/{what}"


def layer_stats(tensors: dict[str, ir.Value], layer: int, token_gram: bool = True) -> tuple[list[ir.Node], dict[str, ir.Value]]:
    """Nodes reducing one block's tapped tensors [1, pos, d] to its statistics; returns them and the outputs by kind.

    tensors: resid_pre, attn_out, resid_post, and when present resid_mid, mlp_out with its twin mlp_out_on_pre.
    token_gram: the Gram matrix is U U^T [pos - 1, pos - 1]; else U^T U [d, d] (the smaller one has no zero eigenvalues).
    """
    nodes: list[ir.Node] = []
    e = Emitter(f"surgery/stats/blocks.{layer}", nodes=nodes)
    last, tokens = e.const("last_axis", [-1]), e.const("token_axis", [1])
    tiny = e.const("tiny", np.array(_TINY))

    cast: dict[str, ir.Value] = {}

    def f64(what):  # [1, pos - 1, d] in float64, token 0 (the attention sink) dropped
        if what not in cast:
            cut = e.op("Slice", [tensors[what], e.const(f"{what}/start", [1]), e.const(f"{what}/end", [2**62]), tokens], f"{what}/from_1")
            cast[what] = e.op("Cast", [cut], f"{what}/f64", to=ir.DataType.DOUBLE)
        return cast[what]

    def dot(p, q, what):  # per token [1, pos - 1, 1]
        return e.op("ReduceSum", [e.op("Mul", [p, q], f"{what}/prod"), last], what, keepdims=1)

    def total(v, what):  # a scalar [1]
        return e.op("Reshape", [e.op("ReduceSum", [v], f"{what}/sum", keepdims=0), e.const(f"{what}/one", [1])], what)

    def unit(v, what):
        norm = e.op("Sqrt", [dot(v, v, f"{what}/norm2")], f"{what}/norm")
        return e.op("Div", [v, e.op("Max", [norm, tiny], f"{what}/norm_safe")], what), norm

    out: dict[str, ir.Value] = {}
    x, a, y = f64("resid_pre"), f64("attn_out"), f64("resid_post")
    u, _ = unit(x, "u")

    def tangential(v, what):
        return e.op("Sub", [v, e.op("Mul", [dot(v, u, f"{what}/along_u"), u], f"{what}/radial")], what)

    pa, pd = tangential(a, "p_attn"), tangential(e.op("Sub", [y, x], "step"), "p_step")
    norms = e.op("Mul", [e.op("Sqrt", [dot(pa, pa, "pa2")], "pa_norm"), e.op("Sqrt", [dot(pd, pd, "pd2")], "pd_norm")], "norms")
    cos = e.op("Div", [dot(pa, pd, "pa_pd"), e.op("Max", [norms, tiny], "norms_safe")], "cos")
    out["align"] = total(cos, "align")

    for point, tensor in POINTS.items():
        if tensor not in tensors:
            continue
        directions = u if point == "pre" else unit(f64(tensor), f"u_{point}")[0]
        summed = e.op("ReduceSum", [directions, tokens], f"sum_u_{point}/vector", keepdims=0)  # [1, d]
        out[f"sum_u.{point}"] = total(e.op("Mul", [summed, summed], f"sum_u_{point}/squares"), f"sum_u_{point}")
        transposed = e.op("Transpose", [directions], f"u_{point}/transposed", perm=[0, 2, 1])
        pair = [directions, transposed] if token_gram else [transposed, directions]
        out[f"gram.{point}"] = e.op("MatMul", pair, f"gram_{point}")  # [1, pos - 1, pos - 1] or [1, d, d]

    if "mlp_out_on_pre" in tensors:
        mh, mx = f64("mlp_out"), f64("mlp_out_on_pre")
        delta = e.op("Sub", [mh, mx], "delta")
        terms = [(delta, delta), (mh, mh), (y, y), (mh, mx), (mx, mx)]
        sums = [total(e.op("Mul", [p, q], f"defect_{i}/prod"), f"defect_{i}") for i, (p, q) in enumerate(terms)]
        out["defect"] = e.op("Concat", sums, "defect", axis=0)  # [5]

    field_in = f64("resid_mid") if "resid_mid" in tensors else x
    out["field_norm"] = e.op("Sqrt", [e.op("ReduceSum", [e.op("Mul", [field_in, field_in], "field/squares"), last], "field/norm2", keepdims=0)], "field_norm")
    for kind, value in out.items():
        value.name = name(layer, kind)
    return nodes, out


def effective_rank(gram: np.ndarray) -> np.ndarray:
    """exp(entropy of the normalised singular values) from Gram matrices [..., n, n] of unit directions
    (their eigenvalues are the squared singular values), as geometry.effective_rank; batched."""
    with threadpool_limits(1, user_api="blas"):  # small matrices; a second BLAS thread competes with ORT's spinning pool
        s = np.sqrt(np.clip(np.linalg.eigvalsh(gram), 0, None))
    p = s / s.sum(axis=-1, keepdims=True)
    logs = np.log(np.where(p > 0, p, 1.0))
    return np.exp(-np.sum(p * logs, axis=-1))


def mean_pairwise_cosine(sum_u_squared: float, n: int) -> float:
    """(|sum u_i|^2 - n) / (n (n - 1)), as geometry.mean_pairwise_cosine."""
    return (sum_u_squared - n) / (n * (n - 1))


def add_to(model: ir.Model, taps: tuple[dict[str, str], ...], tokens: int, d_model: int) -> list[dict[str, str]]:
    """Append every layer's statistics to the probe graph `model` (in place) as float64 outputs, from its tapped
    tensors taps[layer][tensor] (value names), for windows of `tokens` + 1 tokens; return, per layer, the output
    name of each statistic."""
    values = {v.name: v for node in model.graph for v in node.outputs}
    values.update({v.name: v for v in model.graph.inputs})
    names = []
    for layer, tapped in enumerate(taps):
        nodes, out = layer_stats({k: values[v] for k, v in tapped.items()}, layer, token_gram=tokens <= d_model)
        model.graph.extend(nodes)
        for value in out.values():
            value.dtype = ir.DataType.DOUBLE
            model.graph.outputs.append(value)
        names.append({kind: value.name for kind, value in out.items()})
    return names
