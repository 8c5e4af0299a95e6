"""The codes a fix's fold chooses for MatMulNBits weights (surgery.model.nbits): which blocks' output projections are
MatMulNBits (their inputs' second moments are summed in the fit pass), and the error-aware (GPTQ) codes of W_o (I + w_a)
and W_down (I + w_p) (Fix.packed) and of (I + w_in) W for the mlp's input projections (Fix.packed_in)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np
import onnx_ir as ir

from surgery.compensation.equations import InputEquations
from surgery.model.blocks import BlockMap
from surgery.model.subject import Subject
from surgery.passes import Fix, projection


def quantized_outputs(model: "ir.Model | Subject") -> dict[int, tuple[ir.Node, ir.Node]]:
    """The blocks whose W_o and W_down are both MatMulNBits -> those two nodes; no weight is read."""
    subject = Subject.of(model)
    values = subject.values
    found = {}
    for block in subject.blocks:
        o_proj, down = (projection.quantized_node(values[v]) for v in (block.attn_out, block.mlp_out))
        if o_proj is not None and down is not None:
            found[block.layer] = (o_proj, down)
    return found


def input_widths(model: "ir.Model | Subject", layers: Collection[int], requantize: str = "gptq") -> dict[int, tuple[int, ...]]:
    """Per layer, K of W_o and of W_down where both are MatMulNBits and requantized error-aware (their inputs'
    second moments are gathered in the fit pass)."""
    if requantize != "gptq":
        return {}
    return {l: tuple(int(n.attributes["K"].value) for n in pair) for l, pair in quantized_outputs(model).items() if l in layers}


def output_codes(values: dict[str, ir.Value], block: BlockMap, fix: Fix, grams: dict[str, np.ndarray]) -> Fix:
    """`fix` with the codes of W_o (I + w_a) and W_down (I + w_p) chosen error-aware (surgery.model.nbits) on the second
    moments of their inputs, `grams` (INPUT_TAPS); values: the model's, by name."""
    attn, mlp = projection.outputs(values, block, "compensate")
    (w_o, _), (w_down, _) = fix.fold(attn, mlp)
    packed = tuple(p.quant.packed(p.quant.gptq(w, grams[name])) for p, w, name in ((attn, w_o, "o_in"), (mlp, w_down, "down_in")))
    return dataclasses.replace(fix, packed=packed)


def input_codes(model: ir.Model, values: dict[str, ir.Value], block: BlockMap, side: Fix, sums: InputEquations) -> Fix:
    """The input side with the codes of its MatMulNBits mlp input projections chosen error-aware (GPTQ on sum u u', the
    top-left block of the input equations' z'z over both folds); unchanged where they are float projections."""
    found = projection.mlp_inputs(model, values, block)
    if isinstance(found, str) or all(p.quant is None for p in found[1]):
        return side
    d = sums.zd.shape[2]
    gram = sums.zz[:, :d, :d].sum(0)
    codes = tuple(None if p.quant is None else p.quant.packed(p.quant.gptq(side.fold_input(p)[0], gram)) for p in found[1])
    return dataclasses.replace(side, packed_in=codes)
