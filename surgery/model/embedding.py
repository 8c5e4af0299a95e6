"""The token embedding: its node, the table's (vocab, d_model), and the residual stream's float type it sets."""

from __future__ import annotations

import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.files import ops


def embedding(model: ir.Model) -> ir.Node | None:
    """The token embedding: a Gather (or GatherBlockQuantized) from a 2-D weight by a graph input, the one reading
    input_ids first (an ORT-optimized gpt2 lists its position table before it)."""
    found = []
    for node in model.graph:
        table, ids = node.inputs[0] if node.inputs else None, node.inputs[1] if len(node.inputs) > 1 else None
        if node.op_type not in ops.EMBEDDINGS or table is None or ids is None or not ops.is_weight(table):
            continue
        source = _input_behind(ids)
        if table.shape is not None and table.shape.rank() == 2 and source is not None:
            found.append((source.name != "input_ids", len(found), node))
    return min(found, key=lambda f: f[:2])[2] if found else None


def embedding_table(model: ir.Model) -> tuple[int, int] | None:
    """(vocab, d_model) of the token embedding table (unpacked, when quantized), or None."""
    node = embedding(model)
    if node is None:
        return None
    table = node.inputs[0]
    vocab, width = int(table.shape[0]), int(table.shape[1])
    if node.op_type == "GatherBlockQuantized" and table.dtype in (ir.DataType.UINT8, ir.DataType.INT8):
        bits = node.attributes["bits"].value if "bits" in node.attributes else 4
        width = width * 8 // bits  # packed: 8 / bits values a byte
    return vocab, width


def stream_dtype(model: ir.Model) -> ir.DataType:
    """The float type of the residual stream: that of the token embedding table (of its scales when quantized)."""
    node = embedding(model)
    typed = ops.EMBEDDINGS[node.op_type][1] if node is not None else None
    dtype = node.inputs[typed].dtype if node is not None and len(node.inputs) > typed else None
    if dtype is None or not dtype.is_floating_point():
        raise SurgeryError(
            "cannot tell the residual stream's float type: found no token embedding table with a float type; "
            "pass a model whose embedding Gather reads a typed float initializer"
        )
    return dtype


def _input_behind(value: ir.Value, depth: int = 3) -> ir.Value | None:
    """The graph input `value` is, maybe reshaped (dynamo writes Gather(W, Reshape(input_ids))), or None."""
    if value.is_graph_input():
        return value
    node = value.producer()
    if depth > 0 and node is not None and node.op_type in ("Reshape", "Cast", "Unsqueeze"):
        return _input_behind(node.inputs[0], depth - 1)
    return None
