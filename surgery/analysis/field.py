"""The field graph: one block's mlp(ln2(z)) for any z, for the critical points of the mlp field."""

from __future__ import annotations

import onnx_ir as ir

from surgery.model import nodes
from surgery.model.blocks import BlockMap, branch_nodes
from surgery.model.embedding import stream_dtype

FIELD_IN, FIELD_OUT = "surgery_z", "surgery_field"


def field(model: ir.Model, block: BlockMap) -> ir.Model:
    """A graph from `surgery_z` [batch, pos, d_model] to `surgery_field` = mlp(ln2(z)) of one block.

    Only the block's ln2 and mlp nodes are copied, into a new graph sharing their weights (a clone of the whole
    model would cost more than the session)."""
    branch = branch_nodes(model, block, "mlp")
    values = {v.name: v for node in branch for v in (*node.inputs, *node.outputs) if v is not None}
    prefix = f"surgery/field/blocks.{block.layer}"
    z = ir.Value(name=FIELD_IN, type=ir.TensorType(stream_dtype(model)), shape=ir.Shape(["batch", "pos", "d_model"]))
    mapping = {values[block.mlp_in]: z}
    inputs, initializers, copies = [z], [], []
    for node in model.graph:  # graph order is topological: every producer is copied before its users
        if node not in branch:
            continue
        for x in node.inputs:
            if x is not None and x not in mapping:  # a weight or a graph input: the branch reads no other node
                mapping[x] = ir.Value(name=x.name, type=x.type, shape=x.shape, const_value=x.const_value)
                (initializers if x.is_initializer() else inputs).append(mapping[x])
        copy = nodes.copy(node, [None if x is None else mapping[x] for x in node.inputs], prefix)
        mapping.update(zip(node.outputs, copy.outputs))
        copies.append(copy)
    out = mapping[values[block.mlp_out]]
    out.name = FIELD_OUT
    if out.dtype is None:
        out.dtype = z.dtype
    g = ir.Graph(inputs, [out], nodes=copies, initializers=initializers, opset_imports=dict(model.opset_imports), name="surgery_field")
    return ir.Model(g, ir_version=model.ir_version, functions=list(model.functions.values()))
