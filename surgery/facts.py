"""describe(path) -> ModelFacts: what `surgery inspect` shows about an exported model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx_ir as ir

from surgery import graph, metadata, ops
from surgery.blocks import BlockMap
from surgery.errors import SurgeryError


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: str


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """Facts about one exported decoder, read from the graph alone."""

    path: str
    n_layers: int
    d_model: int | None
    vocab: int | None
    form: str  # "sequential", "parallel" or "mixed"
    kv_cache: bool
    opset: int
    ir_version: int
    producer: str
    size_bytes: int
    external_data: tuple[str, ...]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    history: tuple[dict, ...]
    blocks: tuple[BlockMap, ...]

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        for block, raw in zip(self.blocks, data["blocks"]):
            raw["form"] = block.form
        return data


def describe(path: str | Path) -> ModelFacts:
    """Load the model at `path` (weights stay on disk) and gather its facts and block map: what `surgery inspect` shows.

    Args:
        path: an .onnx file, or a folder holding one (`model.onnx` from `surgery export`, a GenAI builder folder).

    Returns:
        A `ModelFacts`: the resolved .onnx path, n_layers, d_model and vocab (None without a token embedding table),
        the form of its blocks (`sequential`, `parallel`, `fused`, or `mixed`), whether it has a KV cache, opset and
        IR version, producer, size on disk in bytes (with its external data files), its inputs and outputs, the
        surgery history the graph records, and one BlockMap per block (`to_json()`: what `inspect --json` prints).

    Raises:
        SurgeryError: the path holds no ONNX model (or several .onnx files), the file is not a valid ONNX model, or
            the graph has no transformer blocks; one line naming the file.
    """
    from surgery.subject import Subject

    file = graph.resolve(path)
    model = graph.load(file)
    blocks = Subject(model, str(file)).blocks
    forms = {b.form for b in blocks}
    table = embedding_table(model)
    return ModelFacts(
        path=str(file),
        n_layers=len(blocks),
        d_model=None if table is None else table[1],
        vocab=None if table is None else table[0],
        form=forms.pop() if len(forms) == 1 else "mixed",
        kv_cache=any(_is_kv(v) for v in model.graph.inputs),
        opset=model.opset_imports.get("", 0),
        ir_version=model.ir_version,
        producer=f"{model.producer_name or '?'} {model.producer_version or ''}".strip(),
        size_bytes=graph.size_on_disk(model, file),
        external_data=tuple(p.name for p in graph.external_data_files(model)),
        inputs=tuple(_info(v) for v in model.graph.inputs),
        outputs=tuple(_info(v) for v in model.graph.outputs),
        history=tuple(metadata.history(model)),
        blocks=tuple(blocks),
    )


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


def _is_kv(value: ir.Value) -> bool:
    return value.dtype is not None and value.dtype.is_floating_point() and value.shape is not None and value.shape.rank() == 4


def _info(value: ir.Value) -> TensorInfo:
    dims = "?" if value.shape is None else "[" + ", ".join(str(d) for d in value.shape) + "]"
    return TensorInfo(value.name, value.dtype.name.lower() if value.dtype is not None else "?", dims)
