"""parallelize: a sequential block's ln2 reads resid_pre, so resid_post = resid_pre + attn_out + mlp(ln2(resid_pre))."""

from __future__ import annotations

from collections.abc import Collection

import onnx_ir as ir

from surgery import metadata
from surgery.blocks import branch_nodes, find_blocks
from surgery.errors import SurgeryError
from surgery.metadata import tag
from surgery.nodes import values_by_name
from surgery.passes.common import Change, Pass, SurgeryResult, check_layers, node_name, record, register

NAME = metadata.PARALLELIZE  # saving splits the sums of the blocks it rewired


def parallelize(model: ir.Model, layers: Collection[int]) -> SurgeryResult:
    """Make each selected sequential block parallel: its mlp branch reads resid_pre instead of resid_mid.

    Nothing else changes: the residual adds, attention and the KV cache are untouched. Blocks that
    are already parallel are reported and left alone.
    """
    model = model.clone()  # weights are shared, not copied
    blocks = find_blocks(model)
    chosen = check_layers(layers, blocks)
    values = values_by_name(model)
    changes = []
    for block in blocks:
        if block.layer not in chosen:
            continue
        if block.is_parallel:
            changes.append(Change(block.layer, "already parallel", applied=False))
            continue
        mlp = branch_nodes(model, block, "mlp", values)
        redirect(model.graph, mlp, values[block.resid_mid], values[block.resid_pre], block.layer)
        changes.append(Change(block.layer, "ln2 reads resid_pre"))
    result = SurgeryResult(model, tuple(changes))
    if result.changed_layers:
        record(model, NAME, result.changed_layers, {})
    return result


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


def switch(board, block, on: ir.Value, prefix: str) -> None:
    """In a switchboard: ln2 reads resid_pre while `on`, resid_mid while off."""
    if block.is_parallel:
        return
    mid, pre = board.values[block.resid_mid], board.values[block.resid_pre]
    mlp = branch_nodes(board.model, block, "mlp", board.values)
    chosen = board.emitter(prefix).op("Where", [on, pre, mid], "mlp_in")
    redirect(board.graph, mlp, mid, chosen, block.layer, "switchboard")


PASS = register(Pass(NAME, parallelize, switch))
