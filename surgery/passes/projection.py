"""Linear projections as the graph computes them: MatMul(x, W) [+ b], Reshape-Gemm-Reshape (optimum's GPT-2), or
MatMulNBits(x, codes, scales) [+ b] (block-quantized weights, surgery.model.nbits); a branch output may scale one by a
constant before the residual add (Granite's residual_multiplier).

Passes that fold something into a block's weights find them here; surgery.passes.fold folds and writes them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.model import nbits
from surgery.model.blocks import BlockMap


@dataclasses.dataclass
class Projection:
    """out = input @ weight + bias, and where the weight and bias live in the graph."""

    input: ir.Value
    output: ir.Value
    weight: np.ndarray  # [in, out]
    bias: np.ndarray | None
    node: ir.Node  # the MatMul or Gemm
    transposed: bool = False  # Gemm with transB: the initializer holds weight.T
    bias_site: tuple[ir.Node, int] | None = None  # (node, input index) of the bias constant
    scale: float = 1.0  # a branch output: output = scale * (input @ weight + bias), the scale a Mul by a constant
    linear: ir.Value | None = None  # the value before that Mul (None: output itself)
    quant: nbits.Quantized | None = None  # MatMulNBits: its codes, scales and zero points (weight: dequantized, float64)

    @property
    def unscaled(self) -> ir.Value:
        """input @ weight + bias, before the scale: where a bias the projection did not have goes."""
        return self.output if self.linear is None else self.linear


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The array of a constant value (an initializer, or a Constant node's tensor), else None."""
    if value is None:
        return None
    node = value.producer()
    if value.const_value is None and node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].value.numpy()
    if value.const_value is None or value.shape is None:
        return None
    return value.const_value.numpy()


def _bias_after(out: ir.Value) -> tuple[ir.Value, np.ndarray | None, tuple[ir.Node, int] | None]:
    """If `out`'s only use is Add(out, 1-D constant), return that Add's output, the bias and its site."""
    uses = out.uses()
    if len(uses) == 1 and uses[0].node.op_type == "Add":
        add = uses[0].node
        other = add.inputs[1 - uses[0].idx]
        bias = constant(other)
        if bias is not None and bias.ndim == 1:
            return add.outputs[0], bias, (add, 1 - uses[0].idx)
    return out, None, None


def reading(source: ir.Value, layer: int) -> list[Projection]:
    """The linear projections reading `source` (an ln output); anything else but shape arithmetic is refused."""
    found = []
    for user, index in list(source.uses()):
        if user.op_type == "Shape":  # reads only the shape, which is resid_pre's
            continue
        if user.op_type == "MatMul" and index == 0 and (w := constant(user.inputs[1])) is not None and w.ndim == 2:
            out, bias, site = _bias_after(user.outputs[0])
            found.append(Projection(source, out, w, bias, user, bias_site=site))
        elif user.op_type == "Reshape" and index == 0 and (p := _gemm_after(user, source)) is not None:
            found.append(p)
        elif user.op_type == nbits.OP and index == 0 and nbits.refusal(user) is None:
            found.append(_quantized(user, *_bias_after(user.outputs[0])))
        else:
            raise SurgeryError(
                f"cannot fuse block {layer}: the ln output {source.name!r} feeds {user.op_type} {user.name!r}, "
                "not a projection; use plain parallel (no --fuse)"
            )
    return found


def _quantized(node: ir.Node, out: ir.Value, bias: np.ndarray | None, site: tuple[ir.Node, int] | None) -> Projection:
    """A MatMulNBits projection, its weight dequantized (float64); its bias the node's own when it holds one."""
    if bias is None and nbits.optional(node, nbits.BIAS) is not None:
        bias, site = constant(node.inputs[nbits.BIAS]), (node, nbits.BIAS)
    q = nbits.read(node)
    return Projection(node.inputs[0], out, q.dequantize(), bias, node, bias_site=site, quant=q)


def _gemm_after(reshape: ir.Node, source: ir.Value) -> Projection | None:
    """Reshape(source, [-1, d]) -> Gemm(., W, b) -> Reshape(., [batch, pos, k]): one projection."""
    uses = reshape.outputs[0].uses()
    if len(uses) != 1 or uses[0].node.op_type != "Gemm" or uses[0].idx != 0:
        return None
    gemm = uses[0].node
    attrs = {k: a.value for k, a in gemm.attributes.items()}
    w = constant(gemm.inputs[1])
    if w is None or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        return None
    transposed = bool(attrs.get("transB", 0))
    w = w.T if transposed else w
    bias = constant(gemm.inputs[2]) if len(gemm.inputs) > 2 else None
    site = (gemm, 2) if bias is not None else None
    after = gemm.outputs[0].uses()
    if len(after) != 1 or after[0].node.op_type != "Reshape":
        return None
    return Projection(source, after[0].node.outputs[0], w, bias, gemm, transposed, site)


def producing(out: ir.Value, layer: int, what: str, why: str = "fuse") -> Projection:
    """The projection producing a branch output: MatMul(h, W) [+ b], or Reshape-Gemm-Reshape, maybe scaled by a
    constant after it (Mul by a one-element constant: a residual multiplier)."""
    scaled = _scaled(out)
    if scaled is not None:
        linear, scale = scaled
        return dataclasses.replace(producing(linear, layer, what, why), output=out, scale=scale, linear=linear)
    node, bias, site = out.producer(), None, None
    if node is not None and node.op_type == "Add":
        for i in (0, 1):
            b = constant(node.inputs[i])
            if b is not None and b.ndim == 1:
                bias, site, node = b, (node, i), node.inputs[1 - i].producer()
                break
    if node is not None and node.op_type == "MatMul" and (w := constant(node.inputs[1])) is not None and w.ndim == 2:
        return Projection(node.inputs[0], out, w, bias, node, bias_site=site)
    if node is not None and node.op_type == nbits.OP:
        if (reason := nbits.refusal(node)) is not None:
            raise SurgeryError(f"cannot {why} block {layer}: {what} {out.name!r} is MatMulNBits, and {reason}")
        return _quantized(node, out, bias, site)
    if node is not None and node.op_type == "Reshape":
        gemm = node.inputs[0].producer()
        first = gemm.inputs[0].producer() if gemm is not None and gemm.op_type == "Gemm" else None
        if first is not None and first.op_type == "Reshape":
            p = _gemm_after(first, first.inputs[0])
            if p is not None:
                return dataclasses.replace(p, input=first.inputs[0], output=out)
    raise SurgeryError(f"cannot {why} block {layer}: {what} {out.name!r} is not a MatMul, Gemm or MatMulNBits with constant weights")


def outputs(values: dict[str, ir.Value], block: BlockMap, why: str = "fuse") -> tuple[Projection, Projection]:
    """The block's two output projections, W_o (producing attn_out) and W_down (producing mlp_out)."""
    return (producing(values[block.attn_out], block.layer, "attn_out", why),
            producing(values[block.mlp_out], block.layer, "mlp_out", why))


def quantized_node(out: ir.Value) -> ir.Node | None:
    """The MatMulNBits node computing a branch output (through a residual multiplier and a bias Add), or None;
    no weight is read."""
    scaled = _scaled(out)
    node = (scaled[0] if scaled else out).producer()
    if node is not None and node.op_type == "Add":
        node = next((node.inputs[1 - i].producer() for i in (0, 1) if (b := constant(node.inputs[i])) is not None and b.ndim == 1), node)
    return node if node is not None and node.op_type == nbits.OP else None


def _scaled(out: ir.Value) -> tuple[ir.Value, float] | None:
    """(x, c) when `out` is Mul(x, c) or Mul(c, x) with c a one-element constant and x read by that Mul alone."""
    node = out.producer()
    if node is None or node.op_type != "Mul":
        return None
    for i in (0, 1):
        c = constant(node.inputs[i])
        x = node.inputs[1 - i]
        if c is not None and c.size == 1 and x is not None and constant(x) is None and len(x.uses()) == 1:
            return x, float(c.reshape(()))
    return None
