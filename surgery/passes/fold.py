"""Folding a Fix into a block's weights, float or MatMulNBits: the one place compensate, fuse and the switchboard fold
one, and the one that says where a fix can go.

    W_o    <- W_o (I + w_a)       b_o    <- b_o (I + w_a)
    W_down <- W_down (I + w_p)    b_down <- b_down (I + w_p) + b / c
    W      <- (I + w_in) W        b      <- b + b_in W          (each of the mlp's input projections)

c is mlp_out's scale (a residual multiplier, else 1). Products are taken in float64 (`exact`) and rounded once to each
weight's own type (`folded`: an fp16 graph stays fp16); MatMulNBits weights are requantized on the node's own scales and
zero points, with the fit's error-aware codes (Fix.packed, Fix.packed_in) where it chose them, else rounded to nearest
(surgery.model.nbits). `set_weights` writes a folded projection as new initializers: an external data file is never
modified. Planning reads the graph: `refusal` (may a pass fold into this block?), `input_projections` (where does an
input side go?), `unfoldable` (the fit's note) and `to_requantize` (what the fit chooses codes for).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np
import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.model import nbits, nodes
from surgery.model.blocks import BlockMap, block_norms, branch_nodes
from surgery.passes import projection
from surgery.passes.fix import Fix
from surgery.passes.projection import Projection

OUTPUTS = ("o_proj", "down_proj")  # what the output side's folded projections are named after


@dataclasses.dataclass(frozen=True)
class Folded:
    """A projection with a fix folded in: its new weight [in, out] and bias [out] (None: it has none), float64 from
    `exact`, as the graph stores them from `folded`; `what` names its new initializers and nodes (o_proj, down_proj,
    mlp_in.<i>)."""

    projection: Projection
    weight: np.ndarray
    bias: np.ndarray | None
    what: str


def output_weights(fix: Fix, attn: Projection, mlp: Projection) -> tuple[tuple[np.ndarray, np.ndarray | None], tuple[np.ndarray, np.ndarray | None]]:
    """(W_o (I + w_a), b_o (I + w_a)), (W_down (I + w_p), b_down (I + w_p) + b / c), float64; a missing bias stays None
    (b_down' is b / c alone when the mlp had no bias). c is mlp_out's scale (a residual multiplier, else 1): the
    fix acts on the scaled outputs, c (h W_down + b_down) (I + w_p) + b = c (h W_down' + b_down'), and the
    weights stay inside the scale."""

    def times(x, w):
        return None if x is None else _times_one_plus(x, w)

    b_down = times(mlp.bias, fix.w_p)
    if fix.b is not None:
        b = np.asarray(fix.b, np.float64) / mlp.scale
        b_down = b if b_down is None else b_down + b
    return (times(attn.weight, fix.w_a), times(attn.bias, fix.w_a)), (times(mlp.weight, fix.w_p), b_down)


def input_weights(fix: Fix, p: Projection) -> tuple[np.ndarray, np.ndarray | None]:
    """One of the mlp's input projections with the fix's input side folded in, float64: ((I + w_in) W, b + b_in W); a
    missing bias stays None when b_in is None."""
    weight = p.weight.astype(np.float64)
    bias = None if p.bias is None else p.bias.astype(np.float64)
    if fix.b_in is not None:
        shift = np.asarray(fix.b_in, np.float64) @ weight
        bias = shift if bias is None else bias + shift
    if fix.w_in is not None:
        weight = weight + np.asarray(fix.w_in, np.float64) @ weight
    return weight, bias


def _times_one_plus(x: np.ndarray, w: np.ndarray | float | None) -> np.ndarray:
    """x (I + w) in float64: w a matrix, a number (w I) or None (0)."""
    x = np.asarray(x, np.float64)
    if w is None:
        return x
    if np.isscalar(w):
        return x * (1.0 + float(w))
    return x + x @ np.asarray(w, np.float64)


def exact(fix: Fix, outputs: tuple[Projection, Projection] | None = None, inputs: Sequence[Projection] = ()) -> list[Folded]:
    """W_o and W_down (`outputs`), then the mlp's input projections (`inputs`, in input_projections' order), with `fix`
    folded in, float64: what fuse scales by a residual multiplier before rounding, and the fit requantizes."""
    sides = []
    if outputs is not None:
        sides += [Folded(p, *weights, what) for p, weights, what in zip(outputs, output_weights(fix, *outputs), OUTPUTS)]
    return sides + [Folded(p, *input_weights(fix, p), f"mlp_in.{i}") for i, p in enumerate(inputs)]


def folded(fix: Fix, outputs: tuple[Projection, Projection] | None = None, inputs: Sequence[Projection] = ()) -> list[Folded]:
    """`exact`'s projections with the new weight and bias as the graph stores them: rounded once to the type of each
    weight, or for MatMulNBits the codes on the node's own scales (the fit's, Fix.packed and Fix.packed_in, where it
    chose them, else rounded to nearest) and the bias in the scales' type."""
    codes = (list(fix.packed) if outputs is not None else []) + [_input_codes(fix, i) for i in range(len(inputs))]
    return [_stored(side, packed) for side, packed in zip(exact(fix, outputs, inputs), codes)]


def _input_codes(fix: Fix, i: int) -> np.ndarray | None:
    """The fit's codes of the i-th mlp input projection (Fix.packed_in), or None: rounded to nearest."""
    return fix.packed_in[i] if fix.packed_in and i < len(fix.packed_in) else None


def _stored(side: Folded, packed: np.ndarray | None) -> Folded:
    """An exact side as the graph stores it: `packed` codes, or rounded once (to nearest codes, or to the weight's type)."""
    p, bias = side.projection, side.bias
    if p.quant is not None:
        codes = packed if packed is not None else p.quant.packed(p.quant.round(side.weight))
        return dataclasses.replace(side, weight=codes, bias=None if bias is None else bias.astype(p.quant.dtype))
    dtype = p.weight.dtype
    return dataclasses.replace(side, weight=side.weight.astype(dtype), bias=None if bias is None else bias.astype(dtype))


def set_weights(graph: ir.Graph, side: Folded, name: str) -> ir.Value:
    """Give a projection the new weight [in, out] and bias [out] of `side` (`folded`'s), as new initializers named `name`/...

    Returns the value that now carries the projection's output: its output, or a new bias Add when the projection had
    no bias and the side has one (added before a scale, as a bias the projection had: the bias is inside the scale).
    Old initializers left unused are dropped.
    """
    p, weight, bias = side.projection, side.weight, side.bias
    old = [p.node.inputs[1]] + ([p.bias_site[0].inputs[p.bias_site[1]]] if p.bias_site else [])
    stored = weight.T if p.transposed else weight
    p.node.replace_input_with(1, nodes.initializer(graph, f"{name}/weight", stored))
    out = p.output
    if bias is not None and p.bias_site is not None:
        node, index = p.bias_site
        node.replace_input_with(index, nodes.initializer(graph, f"{name}/bias", bias))
    elif bias is not None:
        inner = p.unscaled
        uses = list(inner.uses())
        add = ir.node("Add", [inner, nodes.initializer(graph, f"{name}/bias", bias)], name=f"{name}/bias_add")
        added = add.outputs[0]
        added.name, added.type, added.shape = f"{name}/out", inner.type, inner.shape
        for user, index in uses:
            user.replace_input_with(index, added)
        graph.insert_after(inner.producer(), [add])
        out = added if p.linear is None else p.output
    for value in old:
        if value is not None and not value.uses() and value.name in graph.initializers:
            del graph.initializers[value.name]
    return out


def refusal(model: ir.Model, block: BlockMap, verb: str, so: str) -> str | None:
    """Why a pass that folds into a block's projections (`verb`: compensate, fuse) refuses it, or None: its quantized
    weights cannot be read as arrays, or it normalises its branch outputs (`so`: what that rules out, and what to do).
    Read from the graph alone (no weight is loaded)."""
    if (why := _unreadable(model, block, verb)) is not None:
        return why
    if block.post_norm:
        return f"cannot {verb} block {block.layer}: it normalises its branch outputs (Gemma 2 / OLMo 2 style), so {so}"
    return None


def _unreadable(model: ir.Model, block: BlockMap, verb: str) -> str | None:
    """One line saying why a block whose quantized weights cannot be read as arrays (surgery.model.nbits.refusal) is
    refused, or None."""
    for branch in ("attn", "mlp"):
        for node in branch_nodes(model, block, branch):
            if node.op_type == nbits.OP and (reason := nbits.refusal(node)) is not None:
                return f"cannot {verb} block {block.layer}: its projection {node.name!r} is MatMulNBits, and {reason}"
    return None


def input_projections(model: ir.Model, values: dict[str, ir.Value], block: BlockMap) -> tuple[ir.Value, list[Projection]] | str:
    """The value the mlp's input projections read (ln2's output) and those projections (W_gate and W_up, the GenAI
    builder's packed gate_up, or W_fc; MatMulNBits ones are requantized when a fix folds into them), the sites an input
    side (Fix.w_in, b_in) folds into, in the order of Fix.packed_in; or one line saying why there are none to fold into
    (a graph shape the passes do not read)."""
    try:
        source = values[block_norms(model, block, values)[1].output]
        found = projection.reading(source, block.layer)
    except SurgeryError as e:
        return str(e)
    if not found:
        return f"block {block.layer}: no projection reads ln2's output {source.name!r}"
    return source, found


def unfoldable(model: ir.Model, block: BlockMap, values: dict[str, ir.Value] | None = None, side: Literal["outputs", "inputs"] = "outputs"
               ) -> str | None:
    """Why a fit's fix of this sequential block could not be folded into its weights (the fit's note), or None; with
    side `inputs`, also why its input side could not (no mlp input projections found; `values` the model's by name)."""
    if block.post_norm:
        return "branch outputs are normalised: no fold"
    if _unreadable(model, block, "compensate") is not None:
        return "quantized weights that cannot be read: no fold"
    found = input_projections(model, values, block) if side == "inputs" else None
    return found if isinstance(found, str) else None


def to_requantize(model: ir.Model, values: dict[str, ir.Value], block: BlockMap, fix: Fix, side: Literal["outputs", "inputs"]
                  ) -> list[Folded | None]:
    """The projections of `block` that the `side` of `fix` folds into (W_o and W_down, or the mlp's input projections:
    none where they are not found), each with its folded weight, float64, where it is MatMulNBits (the fit chooses
    its codes), and None where it is float (nothing is folded for it here)."""
    if side == "outputs":
        sides = exact(fix, projection.outputs(values, block, "compensate"))
    else:
        found = input_projections(model, values, block)
        sides = exact(fix, inputs=[] if isinstance(found, str) else found[1])
    return [s if s.projection.quant is not None else None for s in sides]
