"""ONNX Runtime sessions: the one place they are made. CUDA when it really works, CPU otherwise."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from surgery import graph
from surgery.errors import SurgeryError

_FATAL_ONLY = 4  # ORT log severity: keep provider-loading errors off a CPU machine's terminal


@functools.cache
def providers() -> tuple[str, ...]:
    """Execution providers to use: CUDA first when a session can really run on it, then CPU."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return ("CPUExecutionProvider",)
    probe = ir.Model(
        ir.Graph(
            inputs=[x := ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1]))],
            outputs=[y := ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1]))],
            nodes=[ir.Node("", "Identity", [x], outputs=[y])],
            opset_imports={"": 17},
        ),
        ir_version=8,
    )
    ort.set_default_logger_severity(_FATAL_ONLY)
    try:
        options = ort.SessionOptions()
        options.log_severity_level = _FATAL_ONLY
        probe_session = ort.InferenceSession(
            ir.to_proto(probe).SerializeToString(), options, providers=["CUDAExecutionProvider"]
        )
        usable = probe_session.get_providers()[0] == "CUDAExecutionProvider"
    except Exception:  # a broken CUDA install must not stop a CPU run
        usable = False
    finally:
        ort.set_default_logger_severity(2)
    return ("CUDAExecutionProvider", "CPUExecutionProvider") if usable else ("CPUExecutionProvider",)


def session(model: ir.Model | str | Path, *, threads: int | None = None) -> ort.InferenceSession:
    """Make an inference session for a model in memory or on disk."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if isinstance(model, ir.Model):
        base = _external_data_folder(model)
        if base is not None:
            options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base))
        source = ir.to_proto(model).SerializeToString()
    else:
        source = str(graph.resolve(model))
    return ort.InferenceSession(source, options, providers=list(providers()))


def feeds(sess: ort.InferenceSession, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs for a full-sequence forward pass: mask of ones, positions 0..n-1, an empty KV cache."""
    batch, length = input_ids.shape
    out: dict[str, np.ndarray] = {}
    for arg in sess.get_inputs():
        if arg.name == "input_ids":
            out[arg.name] = input_ids.astype(np.int64)
        elif arg.name == "attention_mask":
            out[arg.name] = np.ones((batch, length), dtype=np.int64)
        elif arg.name == "position_ids":
            out[arg.name] = np.broadcast_to(np.arange(length, dtype=np.int64), (batch, length)).copy()
        elif arg.name.startswith("past_key_values"):
            heads, head_dim = arg.shape[1], arg.shape[3]
            dtype = np.float16 if "float16" in arg.type else np.float32
            out[arg.name] = np.zeros((batch, heads, 0, head_dim), dtype=dtype)
        else:
            raise SurgeryError(
                f"graph input {arg.name!r} is not one surgery can feed (input_ids, attention_mask, position_ids, "
                "past_key_values.*); export the model with `surgery export`"
            )
    return out


def _external_data_folder(model: ir.Model) -> Path | None:
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            return Path(value.const_value.base_dir)
    return None
