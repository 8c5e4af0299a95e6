"""Model files checked on load, before any work: an ONNX model, text that is text, a well-formed graph, and
external data inside the model's folder and long enough. Weights are never read: data files are stat'ed and
offsets compared, so a model of any size is checked in milliseconds."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import onnx_ir as ir

from surgery.errors import SurgeryError

_REEXPORT = "the file is damaged or was not written by an ONNX exporter: export it again"


def check(model: ir.Model, file: Path) -> None:
    """Refuse a model read from `file` that later work could not trust, in one line naming the tensor, file
    or node at fault and what to do."""
    file = Path(file)
    if file.stat().st_size == 0:
        raise SurgeryError(f"{file} is empty (0 bytes), not an ONNX model; pass an .onnx file written by an ONNX exporter")
    if model.ir_version < 1 or (len(model.graph) == 0 and not model.graph.outputs):
        raise SurgeryError(f"{file} is not an ONNX model (it holds no IR version or no graph); pass an .onnx file written by an ONNX exporter")
    _check_graph(model.graph, file, outer=frozenset())
    _check_text(model, file)
    for tensor in _tensors(model.graph):
        needed = _check_tensor(tensor, file)
        if isinstance(tensor, ir.ExternalTensor):
            _check_external(tensor, needed, file)


def _check_text(model: ir.Model, file: Path) -> None:
    """Names, op types and domains are text: protobuf hands back bytes for a string that is not UTF-8, and
    such a model cannot be written again."""
    model_texts = [model.producer_name, model.domain, *model.opset_imports, *(t for kv in model.metadata_props.items() for t in kv)]
    if (bad := _not_text(model_texts)) is not None:
        raise SurgeryError(f"a model field, opset domain or metadata entry of {file} is not UTF-8 text ({bad!r}); {_REEXPORT}")
    for graph in _graphs(model.graph):
        names = [graph.name, *(v.name for v in (*graph.inputs, *graph.outputs)), *graph.initializers]
        if (bad := _not_text(names)) is not None:
            raise SurgeryError(f"a graph, input, output or initializer name in {file} is not UTF-8 text ({bad!r}); {_REEXPORT}")
        for index, node in enumerate(graph):
            texts = [node.name, node.op_type, node.domain, *(v.name for v in (*node.inputs, *node.outputs) if v is not None)]
            for attr in node.attributes.values():
                texts.append(attr.name)
                if attr.type == ir.AttributeType.STRING and not attr.is_ref():
                    texts.append(attr.value)
            if (bad := _not_text(texts)) is not None:
                raise SurgeryError(
                    f"{_node(node, index)} in {file} has a name, op type, domain or attribute that is not UTF-8 text "
                    f"({bad!r}); {_REEXPORT}"
                )


def _not_text(texts: Iterable) -> bytes | None:
    """The first of `texts` that is neither text nor unset."""
    return next((t for t in texts if t is not None and not isinstance(t, str)), None)


def _check_graph(graph: ir.Graph, file: Path, outer: frozenset[ir.Value]) -> None:
    """Each node reads only values made before it: graph inputs, initializers, earlier nodes' outputs, and in a
    subgraph the values of the graphs around it. onnx_ir loads a dangling input as a value nobody makes, and
    later passes fail on it (clone: "an outer-scope value")."""
    known = set(outer) | set(graph.inputs) | set(graph.initializers.values())
    for index, node in enumerate(graph):
        for value in node.inputs:
            if value is None or value in known:
                continue
            where = _node(node, index)
            maker = value.producer()
            if maker is not None and maker.graph is graph:
                raise SurgeryError(
                    f"{where} in {file} reads {value.name!r} before node {maker.name!r} makes it; the graph is not in "
                    "topological order: export it again, or sort it (onnx_ir.passes.common.TopologicalSortPass)"
                )
            raise SurgeryError(
                f"{where} in {file} reads {value.name!r}, which is neither a graph input, an initializer nor an output of "
                f"an earlier node; {_REEXPORT}"
            )
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.UNDEFINED or attr.value is None:
                raise SurgeryError(f"attribute {attr.name!r} of {_node(node, index)} in {file} has no type or no value; {_REEXPORT}")
            if attr.type == ir.AttributeType.GRAPH:
                _check_graph(attr.value, file, frozenset(known))
            elif attr.type == ir.AttributeType.GRAPHS:
                for subgraph in attr.value:
                    _check_graph(subgraph, file, frozenset(known))
        known.update(node.outputs)
    for value in graph.outputs:
        if value not in known:
            raise SurgeryError(f"graph output {value.name!r} of {file} is made by no node and is no input or initializer; {_REEXPORT}")


def _check_tensor(tensor: ir.TensorProtocol, file: Path) -> int | None:
    """The tensor's dtype is one ONNX defines, its shape has no negative size, and a tensor kept in the file
    itself holds what they say (as onnx.checker.check_tensor checks). Returns its bytes; None for strings."""
    name = f"tensor {tensor.name!r} of {file.name}"
    proto = tensor.raw if isinstance(tensor, ir.serde.TensorProtoTensor) else None
    try:
        dtype = tensor.dtype  # onnx_ir reads a tensor proto's dtype on each use
    except ValueError:
        raise SurgeryError(f"{name} has data type {proto.data_type}, which ONNX does not define; {_REEXPORT}") from None
    dims = [int(d) for d in tensor.shape.numpy()]
    if dtype == ir.DataType.UNDEFINED or any(d < 0 for d in dims):
        raise SurgeryError(f"{name} is {dtype.name}{dims}: no data type, or a negative size; {_REEXPORT}")
    if dtype == ir.DataType.STRING:
        return None
    count = math.prod(dims)
    nbytes = math.ceil(dtype.bitwidth * count / 8)
    if proto is None or proto.data_location == proto.EXTERNAL:
        return nbytes
    if proto.HasField("raw_data"):
        # len() copies the bytes out of the proto, as numpy() does; they are in memory already (inline weights)
        held, needed, unit = len(proto.raw_data), nbytes, "bytes"
    elif dtype.bitwidth >= 8:  # one typed value per element (two for complex); sub-byte types come packed
        held = max(len(getattr(proto, f)) for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"))
        needed, unit = count * (2 if dtype in (ir.DataType.COMPLEX64, ir.DataType.COMPLEX128) else 1), "values"
    else:
        return nbytes
    if held != needed:
        raise SurgeryError(f"{name} is {dtype.name}{dims}, {needed} {unit}, but holds {held}; {_REEXPORT}")
    return nbytes


def _node(node: ir.Node, index: int) -> str:
    """How a message names a node: `node 'name' (OpType)`, or by its place when it has no name."""
    return f"node {node.name!r} ({node.op_type})" if node.name else f"node #{index} ({node.op_type})"


def _check_external(tensor: ir.ExternalTensor, needed: int | None, file: Path) -> None:
    """The tensor's data file lies inside the model's folder (no absolute path, no `..`, no link out of it) and
    holds the `needed` bytes the tensor's dtype and shape take at its offset."""
    location, folder = str(tensor.location), file.parent
    name = f"tensor {tensor.name!r} of {file.name}"
    if "\x00" in location:
        raise SurgeryError(f"{name} keeps its data at {location!r}, which is no file name; {_REEXPORT}")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or Path(location).drive:
        raise SurgeryError(
            f"{name} keeps its data at the absolute path {location!r}; an external data location must be relative to the "
            f"model's folder: move the file into {folder} and name it relative"
        )
    if ".." in Path(location.replace("\\", "/")).parts:
        raise SurgeryError(
            f"{name} keeps its data at {location!r}, outside the model's folder {folder}; move the file into the folder "
            "and name it without '..'"
        )
    path = folder / location
    resolved = path.resolve()
    if not resolved.is_relative_to(folder.resolve()):
        raise SurgeryError(
            f"{name} keeps its data in {location!r}, a link to {resolved} outside the model's folder {folder}; copy the "
            f"file into the folder in its place (cp --remove-destination {resolved} {path})"
        )
    if not path.is_file():
        problem = "does not exist" if not path.exists() else "is not a file"
        raise SurgeryError(f"{name} keeps its data in {location!r}, which {problem} in {folder}; copy the model's data files beside it")
    contained = getattr(tensor, "_check_path_containment", None)  # onnx_ir refuses these when it reads the data
    if contained is not None:
        try:
            contained()
        except ValueError as e:
            raise SurgeryError(f"{name}: {str(e).splitlines()[0]} Copy {location!r} into {folder} as a plain file") from None
    if needed is None:
        return  # strings: no fixed size to compare
    if tensor.length is not None and tensor.length != needed:
        raise SurgeryError(
            f"{name} is {tensor.dtype.name}{list(tensor.shape.numpy())}, {needed} bytes, but its external data length "
            f"says {tensor.length}; {_REEXPORT}"
        )
    offset, size = tensor.offset or 0, path.stat().st_size
    if offset < 0 or offset + needed > size:
        raise SurgeryError(
            f"{name} needs bytes {offset}..{offset + needed} of {location!r} but the file holds {size} bytes (cut short?); "
            f"copy the whole file again"
        )


def _graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """`graph` and each subgraph inside it."""
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for subgraph in attr.value:
                    yield from _graphs(subgraph)


def _tensors(graph: ir.Graph) -> Iterable[ir.TensorProtocol]:
    """Every tensor the model holds: initializers and tensor attributes, in subgraphs too."""
    for g in _graphs(graph):
        yield from (v.const_value for v in g.initializers.values() if v.const_value is not None)
        for node in g:
            for attr in node.attributes.values():
                if attr.is_ref():
                    continue
                if attr.type == ir.AttributeType.TENSOR:
                    yield attr.value
                elif attr.type == ir.AttributeType.TENSORS:
                    yield from attr.value
