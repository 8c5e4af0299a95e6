"""describe(path) -> ModelFacts: what `surgery inspect` shows about an exported model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx_ir as ir

from surgery.files import graph, metadata
from surgery.model.blocks import BlockMap
from surgery.model.embedding import embedding_table
from surgery.model.subject import Subject


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


def _is_kv(value: ir.Value) -> bool:
    return value.dtype is not None and value.dtype.is_floating_point() and value.shape is not None and value.shape.rank() == 4


def _info(value: ir.Value) -> TensorInfo:
    dims = "?" if value.shape is None else "[" + ", ".join(str(d) for d in value.shape) + "]"
    return TensorInfo(value.name, value.dtype.name.lower() if value.dtype is not None else "?", dims)
