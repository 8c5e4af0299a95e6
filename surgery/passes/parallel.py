"""parallelize: a sequential block's ln2 reads resid_pre, so resid_post = resid_pre + attn_out + mlp(ln2(resid_pre))."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.files import metadata
from surgery.files.metadata import tag
from surgery.model.blocks import BlockMap, branch_nodes
from surgery.passes.common import Board, Change, Pass, SurgeryResult, node_name, register
from surgery.passes.driver import apply_pass

NAME = metadata.PARALLELIZE  # saving splits the sums of the blocks it rewired


class Parallelize(Pass):
    """Make each selected sequential block parallel: its mlp branch reads resid_pre instead of resid_mid.

    Nothing else changes: the residual adds, attention and the KV cache are untouched. Blocks that are already
    parallel are reported and left alone."""

    name = NAME

    def done(self, subject, block: BlockMap, args) -> str | None:
        return "already parallel" if block.is_parallel else None

    def apply(self, subject, block: BlockMap, args) -> Change:
        values = subject.values
        mlp = branch_nodes(subject.model, block, "mlp", values)
        redirect(subject.graph, mlp, values[block.resid_mid], values[block.resid_pre], block.layer)
        subject.replace(dataclasses.replace(block, resid_mid=None, mlp_in=block.resid_pre))
        return Change(block.layer, "ln2 reads resid_pre")

    def switch(self, board: Board, block: BlockMap, on: ir.Value, args) -> None:
        """ln2 reads resid_pre while `on`, resid_mid while off."""
        if block.is_parallel:
            return
        mid, pre = board.values[block.resid_mid], board.values[block.resid_pre]
        mlp = branch_nodes(board.model, block, "mlp", board.values)
        chosen = board.emitter().op("Where", [on, pre, mid], "mlp_in")
        redirect(board.graph, mlp, mid, chosen, block.layer, "switchboard")


PARALLELIZE = register(Parallelize())


def parallelize(model, layers: Collection[int]) -> SurgeryResult:
    """Make each selected sequential block parallel (Parallelize): resid_post = resid_pre + attn_out + mlp(ln2(resid_pre)).

    The mlp branch reads resid_pre instead of resid_mid; the residual adds, attention and the KV cache are untouched,
    and the weights are shared with the input, not copied. A block that is parallel already is reported and left alone.

    Args:
        model (ir.Model | Subject): an `onnx_ir.Model`, or a Subject (from `load`, or a result's `.subject`: its blocks are not found again).
            It is not modified: the pass rewrites a copy.
        layers: the blocks to make parallel, by index from 0; negative ones count from the end.

    Returns:
        A SurgeryResult: the new model, one Change per selected block in order ("ln2 reads resid_pre", or why it
        was left alone), and the rewritten subject.

    Raises:
        SurgeryError: a layer out of range (before any work), or a block whose ln2 shares a node with the residual
            add that cannot be copied (a graph shape to report).
    """
    return apply_pass(model, PARALLELIZE, layers)


def redirect(graph: ir.Graph, branch: set[ir.Node], old: ir.Value, new: ir.Value, layer: int, pass_name: str = NAME) -> None:
    """Make the branch's nodes read `new` where they read `old`; nodes outside the branch keep `old`.

    A Cast or Identity that the branch shares with the residual add (optimum writes one for
    RMSNorm) is duplicated, so the residual add still reads `old`.
    """
    for node, index in list(old.uses()):
        if node not in branch:
            continue
        shared = any(user not in branch for out in node.outputs for user, _ in out.uses()) or any(
            out.is_graph_output() for out in node.outputs
        )
        if not shared:
            node.replace_input_with(index, new)
            tag(node, pass_name, layer)
        elif node.op_type in ("Cast", "Identity") and len(node.outputs) == 1:
            copy = ir.Node(
                node.domain,
                node.op_type,
                [new],
                attributes=list(node.attributes.values()),
                name=node_name(pass_name, layer, f"ln2_{node.op_type.lower()}"),
            )
            copy.outputs[0].name = node_name(pass_name, layer, "ln2_input")
            graph.insert_after(node, [copy])
            for user, i in list(node.outputs[0].uses()):
                if user in branch:
                    user.replace_input_with(i, copy.outputs[0])
            tag(copy, pass_name, layer)
        else:
            raise SurgeryError(
                f"cannot parallelize block {layer}: node {node.name!r} ({node.op_type}) feeds both ln2 and the "
                "residual add; report this graph shape"
            )
