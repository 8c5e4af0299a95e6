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
from surgery.passes import Fix, fold, projection


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


def output_codes(model: ir.Model, values: dict[str, ir.Value], block: BlockMap, fix: Fix, grams: dict[str, np.ndarray]) -> Fix:
    """`fix` with the codes of W_o (I + w_a) and W_down (I + w_p) chosen error-aware (surgery.model.nbits) on the second
    moments of their inputs, `grams` (INPUT_TAPS); values: the model's, by name."""
    sides = fold.to_requantize(model, values, block, fix, "outputs")
    packed = tuple(s.projection.quant.packed(s.projection.quant.gptq(s.weight, grams[name])) for s, name in zip(sides, ("o_in", "down_in")))
    return dataclasses.replace(fix, packed=packed)


def input_codes(model: ir.Model, values: dict[str, ir.Value], block: BlockMap, side: Fix, sums: InputEquations) -> Fix:
    """The input side with the codes of its MatMulNBits mlp input projections chosen error-aware (GPTQ on sum u u', the
    top-left block of the input equations' z'z over both folds); unchanged where they are float projections."""
    sides = fold.to_requantize(model, values, block, side, "inputs")
    if all(s is None for s in sides):
        return side
    d = sums.zd.shape[2]
    gram = sums.zz[:, :d, :d].sum(0)
    codes = tuple(None if s is None else s.projection.quant.packed(s.projection.quant.gptq(s.weight, gram)) for s in sides)
    return dataclasses.replace(side, packed_in=codes)
