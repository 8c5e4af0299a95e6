"""compensate: parallel blocks whose output projections absorb a linear fix of the defect.

Each chosen block is parallelized (ln2 reads resid_pre) and its Fix folded into the weights:

    W_o    <- W_o (I + w_a)       b_o    <- b_o (I + w_a)
    W_down <- W_down (I + w_p)    b_down <- b_down (I + w_p) + b

so resid_post = resid_pre + attn_out (I + w_a) + mlp_out (I + w_p) + b with the ops of parallel(l)
(plus one bias Add where the mlp projection had no bias and b is given). A fix with an input side (Fix.w_in, b_in)
is folded into the mlp's input projections too, W <- (I + w_in) W, b <- b + b_in W (a bias Add where one had none
and b_in is given), so the mlp reads ln2(resid_pre) (I + w_in) + b_in at no extra cost. The fold is
surgery.passes.fold's: products in float64, rounded once to each weight's own type (an fp16 graph stays fp16), or
MatMulNBits weights requantized on the node's own scales and zero points (the fit's error-aware codes in Fix.packed,
else rounded to nearest). New weights are new initializers: an external data file is never modified, and only the projections of each chosen
block that its fix folds into are read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.files import metadata
from surgery.files.metadata import tag
from surgery.model.blocks import BlockMap, branch_nodes
from surgery.model.layers import checked
from surgery.model.subject import Subject
from surgery.passes import fold, projection
from surgery.passes.common import Board, Change, Pass, SurgeryResult, node_name, register
from surgery.passes.driver import apply_pass
from surgery.passes.fix import Fix

NAME = "compensate"


@dataclasses.dataclass(frozen=True)
class Compensation:
    """The fix of each block, by layer. after_branch (switchboards only): the output side is added after the branch,
    so what reads attn_out and mlp_out sees them unfixed (compensation's fit taps), instead of folded into the weights.
    Compared by the layers it fixes (a switchboard holds one compensate kind), so a kind survives pickling to Ray."""

    fixes: Mapping[int, Fix] = dataclasses.field(compare=False)
    after_branch: bool = False
    layers: tuple[int, ...] = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(sorted(self.fixes)))


class Compensate(Pass):
    """Make each block in the fixes a compensated parallel block (module docstring). Refuses blocks that are fused,
    or parallel in the model as exported (there is no sequential-to-parallel defect to fix there)."""

    name = NAME
    before = (metadata.PARALLELIZE,)
    Args = Compensation

    def refusal(self, subject, block: BlockMap, args: Compensation) -> str | None:
        return None if block.fix is not None else refusal(subject.model, block, subject.values)

    def done(self, subject, block: BlockMap, args: Compensation) -> str | None:
        return None if block.fix is None else f"already compensated ({block.fix})"

    def apply(self, subject, block: BlockMap, args: Compensation) -> Change:
        g, values, fix, layer = subject.graph, subject.values, args.fixes[block.layer], block.layer
        outputs = projection.outputs(values, block, NAME)
        inputs = _input_side(subject.model, block, values) if fix.fixes_input else []  # block: parallel now, ln2 reads resid_pre
        o_proj, down_proj, *mlp_in = fold.folded(fix, outputs, inputs)
        fold.set_weights(g, o_proj, node_name(NAME, layer, o_proj.what))  # no new node: b_o exists only where W_o had a bias
        out = fold.set_weights(g, down_proj, node_name(NAME, layer, down_proj.what))
        for node in {o_proj.projection.node, down_proj.projection.node, out.producer()}:  # rewired ones too: the driver tags only new nodes
            tag(node, NAME, layer)
        down_proj.projection.node.metadata_props[metadata.FIX] = fix.describe()
        for side in mlp_in:
            out = fold.set_weights(g, side, node_name(NAME, layer, side.what))
            for node in {side.projection.node, out.producer()}:
                tag(node, NAME, layer)
        where = "W_o, W_down and the mlp's input projections" if mlp_in else "W_o and W_down"
        return Change(layer, f"parallel, {fix.describe()}: fix folded into {where}")

    def switch(self, board: Board, block: BlockMap, on: ir.Value, args: Compensation) -> None:
        """The block gets args.fixes[layer] while `on` (switch parallelize on too for the compensated parallel block):
        W_o, W_down and their biases, and with an input side the mlp's input projections, compute with the weights
        `compensate` writes; with args.after_branch the output side is added after the branch instead,
        attn_out w_a + mlp_out w_p + b, so what reads attn_out and mlp_out sees them unfixed, and the input side is
        computed by explicit ops that the mlp's input projections read while on (a fit tap may read u itself)."""
        fix = args.fixes.get(block.layer)
        if fix is None or block.is_parallel:
            return
        inputs: list[projection.Projection] = []
        if fix.fixes_input:
            found = board.mlp_inputs(block)
            if isinstance(found, str):
                raise _no_input_side(block, found)
            u, inputs, readers = found
        if not args.after_branch:
            board.switch_weights(fold.folded(fix, projection.outputs(board.values, block, NAME), inputs), on)
            return
        if inputs:
            e = board.emitter(f"{board.prefix}/mlp_in")
            board.redirect(u, e.op("Where", [on, board.input_fixed(e, u, fix), u], "chosen"), readers)
        board.add_after_branch(block, fix, on)

    def options(self, args: Compensation, layers) -> dict:
        return {"fixes": {str(layer): args.fixes[layer].describe() for layer in layers}}

    def example(self, subject, layers) -> Compensation:
        rng, d = np.random.default_rng(0), subject.d_model
        return Compensation({layer: Fix(w_a=0.05 * rng.standard_normal((d, d)), w_p=0.05 * rng.standard_normal((d, d)),
                                        b=0.1 * rng.standard_normal(d)) for layer in layers})


COMPENSATE = register(Compensate())


def compensate(model: "ir.Model | Subject", fixes: Mapping[int, Fix]) -> SurgeryResult:
    """Make each block in `fixes` (by layer; negative ones count from the end) a compensated parallel block.

    Each block is parallelized (ln2 reads resid_pre) and its Fix folded into its weights (module docstring):
    resid_post = resid_pre + attn_out (I + w_a) + mlp_out (I + w_p) + b, with the ops of the plain parallel block (and a
    bias Add where a projection had none and the fix gives one). New weights are new initializers: an external data
    file is never modified. A block compensated already is reported and left alone.

    Args:
        model: an `onnx_ir.Model`, or a Subject (from `load`, or a result's `.subject`); it is not modified.
        fixes: layer -> the Fix to fold in, e.g. `{layer: f.fix for layer, f in surgery.fit(...).items()}`;
            Fix.gate(alpha) gives the calibrated block. Only these layers are rewritten.

    Returns:
        A SurgeryResult: the new model, one Change per block in `fixes`, in layer order (what was folded where, or why
        it was left alone), and the rewritten subject.

    Raises:
        SurgeryError: before any work, a layer out of range or a block that cannot be compensated: fused, parallel in
            the model as exported, normalising its branch outputs (Gemma 2, OLMo 2), or with MatMulNBits weights that
            cannot be read as arrays; while rewriting, an output projection that is not a MatMul, Gemm or MatMulNBits
            with constant weights, or a fix with an input side where there are no mlp input projections to fold it into.
    """
    subject = Subject.of(model)
    fixes = {checked(layer, subject.n_layers): fix for layer, fix in fixes.items()}
    return apply_pass(subject, COMPENSATE, fixes, Compensation(fixes))


def _input_side(model: ir.Model, block: BlockMap, values: dict[str, ir.Value]) -> list[projection.Projection]:
    """The mlp input projections an input fix folds into; SurgeryError naming the block when there are none to fold into."""
    found = fold.input_projections(model, values, block)
    if isinstance(found, str):
        raise _no_input_side(block, found)
    return found[1]


def _no_input_side(block: BlockMap, why: str) -> SurgeryError:
    """The error of a fix whose input side has no mlp input projections to fold into (`why`: fold.input_projections')."""
    return SurgeryError(f"cannot fold the mlp input side of block {block.layer}'s fix: {why}")


def refusal(model: ir.Model, block: BlockMap, values: dict[str, ir.Value] | None = None) -> str | None:
    """Why `block` cannot be compensated (fused, or parallel as exported), or None."""
    if block.fused:
        return f"cannot compensate block {block.layer}: it is fused; use `parallelize --fuse --compensate` on the original model"
    why = fold.refusal(model, block, "compensate", "a fix of attn_out and mlp_out cannot be folded into W_o and W_down; "
                       "parallelize it plain with --no-compensate")
    if why is not None:
        return why
    if block.is_parallel and not any(metadata.made_by(n) == metadata.PARALLELIZE for n in branch_nodes(model, block, "mlp", values)):
        return (
            f"cannot compensate block {block.layer}: it is parallel in the model as exported, so it has no "
            "sequential-to-parallel defect to fix; use `ablate --mode scale` to rescale a branch"
        )
    return None
