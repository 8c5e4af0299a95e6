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

import dataclasses
from collections.abc import Collection

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery.blocks import BlockMap, block_norms, find_blocks
from surgery.errors import SurgeryError
from surgery.passes.common import Change, SurgeryResult, check_layers, node_name, record, tag
from surgery.graph import values_by_name
from surgery.passes.parallel import parallelize

PASS = "fuse"


@dataclasses.dataclass
class _Projection:
    """out = input @ weight + bias, as the graph computes it (MatMul [+ Add], or Reshape-Gemm-Reshape)."""

    input: ir.Value
    output: ir.Value
    weight: np.ndarray  # [in, out]
    bias: np.ndarray | None


def fuse(model: ir.Model, layers: Collection[int], mlp_scale: dict[int, float] | None = None) -> SurgeryResult:
    """Rewrite each selected block into the fused parallel form; sequential blocks are parallelized first.

    mlp_scale: per layer, a factor folded into W_down (and b_down): the calibrated parallel block.
    """
    mlp_scale = mlp_scale or {}
    chosen = check_layers(layers, find_blocks(model))
    parallel = parallelize(model, chosen)
    model = parallel.model  # already a copy
    changes = []
    for layer in sorted(chosen):
        block = find_blocks(model)[layer]  # afresh: fusing a block renames the next block's resid_pre
        if block.fused:
            changes.append(Change(layer, "already fused", applied=False))
            continue
        _fuse_block(model, block, values_by_name(model), mlp_scale.get(layer, 1.0))
        RemoveUnusedNodesPass()(model)  # the old ln, projections and residual adds
        model.graph.sort()
        changes.append(Change(layer, "one normalisation, [q|k|v|mlp in] and [o ; mlp out] MatMuls"))
    result = SurgeryResult(model, tuple(changes))
    if result.changed_layers:
        scales = {str(k): v for k, v in sorted(mlp_scale.items()) if k in result.changed_layers}
        record(model, PASS, result.changed_layers, {"mlp_scale": scales} if scales else {})
    return result


def _fuse_block(model: ir.Model, block: BlockMap, values: dict[str, ir.Value], mlp_scale: float) -> None:
    g, layer = model.graph, block.layer
    ln1, ln2 = block_norms(model, block)
    if ln1.kind != ln2.kind:
        raise SurgeryError(f"cannot fuse block {layer}: ln1 is {ln1.kind} but ln2 is {ln2.kind}")
    x = values[block.resid_pre]
    dtype = x.dtype or values[ln1.scale].dtype
    np_dtype = dtype.numpy()

    inputs = []  # (projection, ln) in the order their outputs are concatenated
    for ln in (ln1, ln2):
        out = values[ln.output]
        for user, index in list(out.uses()):
            if user.op_type == "Shape":  # shape arithmetic: the ln output has resid_pre's shape
                user.replace_input_with(index, x)
        inputs += [(p, ln) for p in _projections(out, layer)]
    attn_out = _output_projection(values[block.attn_out], layer, "attn_out")
    mlp_out = _output_projection(values[block.mlp_out], layer, "mlp_out")

    def fold(p: _Projection, ln) -> tuple[np.ndarray, np.ndarray]:
        scale = values[ln.scale].const_value.numpy().astype(np.float64)
        weight = p.weight.astype(np.float64)
        bias = np.zeros(weight.shape[1]) if p.bias is None else p.bias.astype(np.float64)
        if ln.bias is not None:
            bias = bias + values[ln.bias].const_value.numpy().astype(np.float64) @ weight
        return scale[:, None] * weight, bias

    folded = [fold(p, ln) for p, ln in inputs]
    w_in = np.concatenate([w for w, _ in folded], axis=1).astype(np_dtype)
    b_in = np.concatenate([b for _, b in folded]).astype(np_dtype)
    w_out = np.concatenate([attn_out.weight, mlp_scale * mlp_out.weight.astype(np.float64)], axis=0).astype(np_dtype)
    b_out = np.zeros(w_out.shape[1])
    for p, factor in ((attn_out, 1.0), (mlp_out, mlp_scale)):
        if p.bias is not None:
            b_out = b_out + factor * p.bias.astype(np.float64)
    b_out = b_out.astype(np_dtype)

    nodes: list[ir.Node] = []

    def op(op_type, args, what, num_outputs=1, **attributes):
        node = ir.node(op_type, args, attributes=attributes, num_outputs=num_outputs, name=node_name(PASS, layer, what))
        for i, v in enumerate(node.outputs):
            v.name = node_name(PASS, layer, what if num_outputs == 1 else f"{what}_{i}")
        nodes.append(node)
        return node.outputs if num_outputs > 1 else node.outputs[0]

    def const(what, array):
        value = ir.Value(name=node_name(PASS, layer, what), const_value=ir.tensor(array, name=node_name(PASS, layer, what)))
        g.register_initializer(value)
        return value

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
    if np.any(b_out):
        both = op("Add", [both, const("b_out", b_out)], "out_proj_bias")
    post = op("Add", [x, both], "resid_post")
    for node in nodes:
        tag(node, PASS, layer)
    g.extend(nodes)
    values[block.resid_post].replace_all_uses_with(post, replace_graph_outputs=True)


def _normalize(op, const, x, ln, d_model: int, np_dtype):
    """normalize(x) without scale or bias: LayerNormalization with ones / zeros, or x / rms(x)."""
    axes = const("axes", np.array([-1], dtype=np.int64))
    if ln.kind == "LayerNorm":
        ones, zeros = const("ones", np.ones(d_model, np_dtype)), const("zeros", np.zeros(d_model, np_dtype))
        return op("LayerNormalization", [x, ones, zeros], "norm", axis=-1, epsilon=ln.eps)
    square = op("Mul", [x, x], "square")
    mean = op("ReduceMean", [square, axes], "mean_square", keepdims=1)
    rms = op("Sqrt", [op("Add", [mean, const("eps", np.array(ln.eps, np_dtype))], "plus_eps")], "rms")
    return op("Div", [x, rms], "norm")


def _weight(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or value.shape is None:
        return None
    return value.const_value.numpy()


def _bias_after(out: ir.Value) -> tuple[ir.Value, np.ndarray | None]:
    """If `out`'s only use is Add(out, 1-D constant), return that Add's output and the bias."""
    uses = out.uses()
    if len(uses) == 1 and uses[0].node.op_type == "Add":
        add = uses[0].node
        other = add.inputs[1 - uses[0].idx]
        bias = _weight(other)
        if bias is not None and bias.ndim == 1:
            return add.outputs[0], bias
    return out, None


def _projections(source: ir.Value, layer: int) -> list[_Projection]:
    """The linear projections reading `source` (an ln output)."""
    found = []
    for user, index in list(source.uses()):
        if user.op_type == "MatMul" and index == 0 and (w := _weight(user.inputs[1])) is not None and w.ndim == 2:
            out, bias = _bias_after(user.outputs[0])
            found.append(_Projection(source, out, w, bias))
        elif user.op_type == "Reshape" and index == 0 and (p := _gemm_after(user, source)) is not None:
            found.append(p)
        else:
            raise SurgeryError(
                f"cannot fuse block {layer}: the ln output {source.name!r} feeds {user.op_type} {user.name!r}, "
                "not a projection; use plain parallel (no --fuse)"
            )
    return found


def _gemm_after(reshape: ir.Node, source: ir.Value) -> _Projection | None:
    """Reshape(source, [-1, d]) -> Gemm(., W, b) -> Reshape(., [batch, pos, k]): one projection."""
    uses = reshape.outputs[0].uses()
    if len(uses) != 1 or uses[0].node.op_type != "Gemm" or uses[0].idx != 0:
        return None
    gemm = uses[0].node
    attrs = {k: a.value for k, a in gemm.attributes.items()}
    w = _weight(gemm.inputs[1])
    if w is None or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        return None
    w = w.T if attrs.get("transB", 0) else w
    bias = _weight(gemm.inputs[2]) if len(gemm.inputs) > 2 else None
    after = gemm.outputs[0].uses()
    if len(after) != 1 or after[0].node.op_type != "Reshape":
        return None
    return _Projection(source, after[0].node.outputs[0], w, bias)


def _output_projection(out: ir.Value, layer: int, what: str) -> _Projection:
    """The projection producing a branch output: MatMul(h, W) [+ b], or Reshape-Gemm-Reshape."""
    node, bias = out.producer(), None
    if node is not None and node.op_type == "Add":
        for i in (0, 1):
            b = _weight(node.inputs[i])
            if b is not None and b.ndim == 1:
                bias, node = b, node.inputs[1 - i].producer()
                break
    if node is not None and node.op_type == "MatMul" and (w := _weight(node.inputs[1])) is not None and w.ndim == 2:
        return _Projection(node.inputs[0], out, w, bias)
    if node is not None and node.op_type == "Reshape":
        gemm = node.inputs[0].producer()
        first = gemm.inputs[0].producer() if gemm is not None and gemm.op_type == "Gemm" else None
        if first is not None and first.op_type == "Reshape":
            p = _gemm_after(first, first.inputs[0])
            if p is not None:
                return _Projection(first.inputs[0], out, p.weight, p.bias)
    raise SurgeryError(f"cannot fuse block {layer}: {what} {out.name!r} is not a MatMul or Gemm with constant weights")
