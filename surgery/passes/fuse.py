"""fuse: the parallel block computed with one normalisation and two MatMuls.

    n = normalize(resid_pre)                                  # no scale, no bias
    [q | k | v | gate | up] = n @ [g1*W_q | g1*W_k | g1*W_v | g2*W_gate | g2*W_up] + b
    attn_out + mlp_out = [o_in | mlp_hidden] @ [W_o ; W_down] + (b_o + b_down)
    resid_post = resid_pre + that

Each ln's scale g (and LayerNorm bias b: b @ W) is folded into the weights, so the function equals
parallel(l) up to float error. Attention internals (heads, rotary, KV cache, mask) are untouched:
only the projections that read ln1 / ln2 and the two output projections are replaced.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery import metadata, nodes
from surgery.blocks import BlockMap, block_norms, find_blocks
from surgery.errors import SurgeryError
from surgery.metadata import tag
from surgery.nodes import Emitter, values_by_name
from surgery.passes import projection
from surgery.passes.common import Change, Fix, Pass, SurgeryResult, check_layers, narrower_than_float32, node_name, record, register
from surgery.passes.parallel import parallelize

NAME = metadata.FUSE  # find_blocks tells a fused block by it


def fuse(model: ir.Model, layers: Collection[int], fixes: Mapping[int, Fix] | None = None) -> SurgeryResult:
    """Rewrite each selected block into the fused parallel form; sequential blocks are parallelized first.

    fixes: per layer, a linear fix folded into [W_o ; W_down] and the output bias (see compensate):
    the compensated, or with Fix.gate(alpha) the calibrated, parallel block.
    """
    fixes = dict(fixes or {})
    blocks = find_blocks(model)
    chosen = check_layers(layers, blocks)
    for block in blocks:
        if block.layer in chosen and (why := refusal(model, block)) is not None:
            raise SurgeryError(why)
    parallel = parallelize(model, chosen)
    model = parallel.model  # already a copy
    changes = []
    for layer in sorted(chosen):
        block = find_blocks(model)[layer]  # afresh: fusing a block renames the next block's resid_pre
        if block.fused:
            changes.append(Change(layer, "already fused", applied=False))
            continue
        _fuse_block(model, block, values_by_name(model), fixes.get(layer, Fix()))
        RemoveUnusedNodesPass()(model)  # the old ln, projections and residual adds
        model.graph.sort()
        changes.append(Change(layer, "one normalisation, [q|k|v|mlp in] and [o ; mlp out] MatMuls"))
    result = SurgeryResult(model, tuple(changes))
    if result.changed_layers:
        fixed = {str(k): v.describe() for k, v in sorted(fixes.items()) if k in result.changed_layers and not v.is_identity}
        record(model, NAME, result.changed_layers, {"fixes": fixed} if fixed else {})
    return result


def refusal(model: ir.Model, block: BlockMap) -> str | None:
    """Why `block` cannot be fused, or None; read from the graph before any work (no weight is loaded)."""
    if (why := projection.quantized_refusal(model, block, "fuse")) is not None:
        return why
    if block.fused:
        return None  # fuse says it is already fused
    if block.post_norm:
        return (
            f"cannot fuse block {block.layer}: it normalises its branch outputs (Gemma 2 / OLMo 2 style), so attn_out "
            "and mlp_out cannot come from one [o ; down] MatMul; parallelize it without --fuse"
        )
    values = values_by_name(model)
    try:
        ln1, ln2 = block_norms(model, block, values)
        for ln in (ln1, ln2):
            projection.reading(values[ln.output], block.layer)
        projection.producing(values[block.attn_out], block.layer, "attn_out")
        projection.producing(values[block.mlp_out], block.layer, "mlp_out")
    except SurgeryError as e:
        return str(e)
    if ln1.kind != ln2.kind:
        return f"cannot fuse block {block.layer}: ln1 is {ln1.kind} but ln2 is {ln2.kind}"
    if ln1.eps is None or ln1.eps != ln2.eps:
        what = "is not one constant" if ln1.eps is None or ln2.eps is None else f"of ln1 ({ln1.eps:g}) and ln2 ({ln2.eps:g}) differ"
        return f"cannot fuse block {block.layer}: the normalisations' epsilon {what}, and the fused block has one; parallelize it without --fuse"
    return None


def _fuse_block(model: ir.Model, block: BlockMap, values: dict[str, ir.Value], fix: Fix) -> None:
    g, layer = model.graph, block.layer
    ln1, ln2 = block_norms(model, block, values)
    x = values[block.resid_pre]

    inputs = []  # (projection, ln) in the order their outputs are concatenated
    for ln in (ln1, ln2):
        out = values[ln.output]
        for user, index in list(out.uses()):
            if user.op_type == "Shape":  # shape arithmetic: the ln output has resid_pre's shape
                user.replace_input_with(index, x)
        inputs += [(p, ln) for p in projection.reading(out, layer)]
    attn_out = projection.producing(values[block.attn_out], layer, "attn_out")
    mlp_out = projection.producing(values[block.mlp_out], layer, "mlp_out")

    def fold(p: projection.Projection, ln) -> tuple[np.ndarray, np.ndarray]:
        scale = values[ln.scale].const_value.numpy().astype(np.float64)
        weight = p.weight.astype(np.float64)
        bias = np.zeros(weight.shape[1]) if p.bias is None else p.bias.astype(np.float64)
        if ln.bias is not None:
            bias = bias + values[ln.bias].const_value.numpy().astype(np.float64) @ weight
        return scale[:, None] * weight, bias

    # Folded in float64 and rounded once to the weights' own type (the graph's: fp16 stays fp16).
    np_dtype = np.result_type(*(p.weight for p, _ in inputs))
    folded = [fold(p, ln) for p, ln in inputs]
    w_in = np.concatenate([w for w, _ in folded], axis=1).astype(np_dtype)
    b_in = np.concatenate([b for _, b in folded]).astype(np_dtype)
    (w_o, b_o), (w_down, b_down) = fix.fold(attn_out, mlp_out)
    scaled = lambda x, p: None if x is None else x * p.scale  # noqa: E731  a residual multiplier goes into the fused weights
    w_o, b_o, w_down, b_down = scaled(w_o, attn_out), scaled(b_o, attn_out), scaled(w_down, mlp_out), scaled(b_down, mlp_out)
    out_dtype = np.result_type(attn_out.weight, mlp_out.weight)
    w_out = np.concatenate([w_o, w_down], axis=0).astype(out_dtype)
    b_out = sum((b for b in (b_o, b_down) if b is not None), np.zeros(w_out.shape[1])).astype(out_dtype)

    built: list[ir.Node] = []
    e = Emitter(node_name(NAME, layer, "").rstrip("/"), nodes=built)
    op = e.op
    const = lambda what, array: nodes.initializer(g, e.name(what), array)  # noqa: E731  weights-sized: initializers

    d_model = int(values[ln1.scale].shape[0])
    n = _normalize(op, const, x, ln1, d_model, np_dtype)  # [batch, pos, d_model]
    projected = op("MatMul", [n, const("w_in", w_in)], "in_proj")
    if np.any(b_in):
        projected = op("Add", [projected, const("b_in", b_in)], "in_proj_bias")
    sizes = const("split_sizes", np.array([p.weight.shape[1] for p, _ in inputs], dtype=np.int64))
    pieces = op("Split", [projected, sizes], "split", num_outputs=len(inputs), axis=-1)
    pieces = pieces if isinstance(pieces, (list, tuple)) else [pieces]
    for (p, _), piece in zip(inputs, pieces):
        p.output.replace_all_uses_with(piece)
    hidden = op("Concat", [attn_out.input, mlp_out.input], "out_proj_input", axis=-1)
    both = op("MatMul", [hidden, const("w_out", w_out)], "out_proj")
    if not fix.is_identity:
        built[-1].metadata_props[metadata.FIX] = fix.describe()
    if np.any(b_out):
        both = op("Add", [both, const("b_out", b_out)], "out_proj_bias")
    post = op("Add", [x, both], "resid_post")
    for node in built:
        tag(node, NAME, layer)
    g.extend(built)
    values[block.resid_post].replace_all_uses_with(post, replace_graph_outputs=True)


def _normalize(op, const, x, ln, d_model: int, np_dtype):
    """normalize(x) without scale or bias: LayerNormalization with ones / zeros, or x / rms(x)."""
    axes = const("axes", np.array([-1], dtype=np.int64))
    if ln.kind == "LayerNorm":
        ones, zeros = const("ones", np.ones(d_model, np_dtype)), const("zeros", np.zeros(d_model, np_dtype))
        return op("LayerNormalization", [x, ones, zeros], "norm", axis=-1, epsilon=ln.eps)  # statistics in float32 (stash_type)
    narrow = narrower_than_float32(np_dtype)  # x**2 over d_model overflows float16: float32 between Casts, as the exporter's RMSNorm
    wide = op("Cast", [x], "resid_pre_float", to=ir.DataType.FLOAT) if narrow else x
    square = op("Mul", [wide, wide], "square")
    mean = op("ReduceMean", [square, axes], "mean_square", keepdims=1)
    eps = np.array(ln.eps, np.float32 if narrow else np_dtype)
    rms = op("Sqrt", [op("Add", [mean, const("eps", eps)], "plus_eps")], "rms")
    n = op("Div", [wide, rms], "norm")
    return op("Cast", [n], "norm_" + np_dtype.name, to=ir.DataType.from_numpy(np_dtype)) if narrow else n


PASS = register(Pass(NAME, fuse))  # no switch: a fused block is not one the switchboard can turn off
