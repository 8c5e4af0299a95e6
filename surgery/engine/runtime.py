"""ONNX Runtime sessions: the one place they are made. CUDA when it really works, CPU otherwise."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from surgery.errors import SurgeryError
from surgery.files import config, graph, ops
from surgery.files.checkpoint import checkpointable

_FATAL_ONLY = 4  # ORT log severity: keep provider-loading errors off a CPU machine's terminal
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
OPTIMIZATION = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Session options; every graph compared in one measurement gets the same."""

    threads: int | None = None  # intra-op threads; None lets ORT pick (all cores)
    inter_threads: int | None = None  # for execution="parallel": branches run concurrently
    optimization: str = "all"
    execution: str = "sequential"  # or "parallel": independent nodes (attention and mlp) run at once
    device: str = "auto"  # "auto" (CUDA when usable), "cuda" or "cpu"
    profile: str | None = None  # file prefix: ORT writes a JSON profile of every kernel run there (see `placement`)
    memory_reuse: bool = True  # False: no plan of buffers shared between values (see `analysis`)
    spinning: bool = True  # False: ORT's idle threads sleep at once instead of spinning (NumPy work between runs)
    cuda_graph: bool = False  # on CUDA, ORT captures a bound run's kernels as a CUDA graph and replays it (Prepared with a graph id)


def analysis(options: Options) -> Options:
    """The options for sessions of analysis graphs (probes with hundreds of outputs, switchboards), which run
    a few windows each: ORT's buffer-reuse plan is skipped (its arena still recycles freed buffers), which
    shortens the start of a session with hundreds of outputs."""
    return dataclasses.replace(options, memory_reuse=False)


@functools.cache
def cuda_usable() -> bool:
    """True when a session can really run on CUDA; checked quietly, so a CPU machine prints nothing."""
    if CUDA not in ort.get_available_providers():
        return False
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1]))
    node = ir.node("Identity", [x])
    node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape([1])
    probe = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 17}), ir_version=8)
    ort.set_default_logger_severity(_FATAL_ONLY)
    try:
        options = ort.SessionOptions()
        options.log_severity_level = _FATAL_ONLY
        session = ort.InferenceSession(ir.to_proto(probe).SerializeToString(), options, providers=[CUDA])
        session.run(None, {"x": np.zeros(1, np.float32)})  # a session can start where no kernel can run
        return session.get_providers()[0] == CUDA
    except Exception:  # a broken CUDA install must not stop a CPU run
        return False
    finally:
        ort.set_default_logger_severity(2)


def clashing_builds() -> str | None:
    """A warning when more than one ONNX Runtime build is installed: pip puts them in one package folder,
    the last one installed wins file by file, and CUDA disappears from the providers without an error."""
    import importlib.metadata

    builds = sorted({d.metadata["Name"].lower() for d in importlib.metadata.distributions()} & _ORT_BUILDS)
    if len(builds) < 2:
        return None
    keep = "onnxruntime-gpu" if "onnxruntime-gpu" in builds else builds[0]
    return (
        f"{' and '.join(builds)} are all installed and share one package folder, so CUDA may be missing; "
        f"run `pip uninstall -y {' '.join(builds)} && pip install {keep}`"
    )


_ORT_BUILDS = {"onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn"}


DEVICES = ("auto", "cuda", "cpu")


def providers(device: str = "auto") -> tuple[str, ...]:
    """Execution providers for `device`: CUDA first when asked for (or usable, for auto), then CPU."""
    if device not in DEVICES:
        raise SurgeryError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    if device == "cpu" or (device == "auto" and not cuda_usable()):
        return (CPU,)
    if device == "cuda" and not cuda_usable():
        raise SurgeryError("--device cuda was asked for but CUDA is not usable here; use --device cpu or auto")
    return (CUDA, CPU)


class Session:
    """An ONNX Runtime session and what surgery keeps beside it: the weight buffers ORT reads in place (they
    live as long as the session) and the KV cache sizes a graph leaves symbolic. Everything else is ORT's own
    InferenceSession, `ort`, to which the calls it does not know go (run, get_inputs, io_binding, ...)."""

    def __init__(self, sess: ort.InferenceSession, weights: dict[str, np.ndarray], kv_sizes: tuple[int, int] | None):
        self.ort, self.weights, self.kv_sizes = sess, weights, kv_sizes

    def __getattr__(self, name: str):
        return getattr(self.ort, name)


def session(model: ir.Model | str | Path, options: Options = Options()) -> Session:
    """Make an inference session for a model in memory or on disk."""
    if options.optimization not in OPTIMIZATION:
        raise SurgeryError(f"unknown optimization level {options.optimization!r}; use one of {', '.join(OPTIMIZATION)}")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = OPTIMIZATION[options.optimization]
    if options.threads:
        so.intra_op_num_threads = options.threads
    so.enable_mem_reuse = options.memory_reuse
    if not options.spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if options.profile:
        so.enable_profiling = True
        so.profile_file_prefix = options.profile
    if options.execution == "parallel":
        so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        if options.inter_threads:
            so.inter_op_num_threads = options.inter_threads
    elif options.execution != "sequential":
        raise SurgeryError(f"unknown execution mode {options.execution!r}; use sequential or parallel")
    arrays: dict[str, np.ndarray] = {}
    if isinstance(model, ir.Model):
        base = next(iter(graph.external_data(model).values()), None)
        if base is not None:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base))
        source, arrays = _proto_without_big_weights(model)
        if arrays:
            so.add_external_initializers(list(arrays), [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays.values()])
        kv = None  # graph.load states them in the graph
    else:
        source = str(graph.resolve(model))
        graph.read(source)  # checked as graph.load checks it, before ORT opens it
        kv = config.kv_sizes(graph.resolve(model).parent)
    chosen: list = list(providers(options.device))
    if options.cuda_graph and chosen[0] == CUDA:  # ORT refuses the session unless every node runs on CUDA
        chosen[0] = (CUDA, {"enable_cuda_graph": "1"})
    try:
        sess = ort.InferenceSession(source, so, providers=chosen)
    except ort.capi.onnxruntime_pybind11_state.NotImplemented as e:
        first = str(e).splitlines()[0]
        where = "ONNX Runtime's CPU provider" if chosen == [CPU] else "ONNX Runtime here"
        hint = "; it computes in bfloat16, which ORT runs on CUDA: use --device cuda" if _bfloat16(model, source) else ""
        raise SurgeryError(f"{where} cannot run this graph ({first.split(' : ')[-1]}){hint}") from None
    return Session(sess, arrays, kv)


def _bfloat16(model, source) -> bool:
    """Whether a model's graph inputs or outputs are bfloat16 (read again from `source` when `model` is a path)."""
    m = model if isinstance(model, ir.Model) else graph.read(source)
    return any(v.dtype == ir.DataType.BFLOAT16 for v in (*m.graph.inputs, *m.graph.outputs))


_HANDED_OVER = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT8, ir.DataType.UINT8}


def _proto_without_big_weights(model: ir.Model, threshold: int = 1 << 20) -> tuple[bytes, dict[str, np.ndarray]]:
    """The serialized model with each in-memory weight of >= threshold bytes left as an external
    reference, and those weights as arrays to hand to ORT directly: serializing hundreds of MB of weights
    into a protobuf (and ORT parsing them back) costs seconds per session; handing them over does not."""
    moved: dict[str, ir.TensorProtocol] = {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.dtype not in _HANDED_OVER or tensor.nbytes < threshold:
            continue
        moved[name] = tensor
        value.const_value = ir.ExternalTensor(
            _IN_MEMORY, offset=0, length=tensor.nbytes, dtype=tensor.dtype, shape=tensor.shape, name=name, base_dir=""
        )
    try:
        source = ir.to_proto(model).SerializeToString()
    finally:
        for name, tensor in moved.items():
            model.graph.initializers[name].const_value = tensor
    return source, {name: np.ascontiguousarray(tensor.numpy()) for name, tensor in moved.items()}


_IN_MEMORY = "surgery-in-memory"


@dataclasses.dataclass(frozen=True)
class Portable:
    """A model in a form that pickles (for Ray actors): the serialized graph, its big in-memory weights
    as arrays beside it, and the folder of its external data files (which every worker must see)."""

    proto: bytes
    arrays: dict[str, np.ndarray]
    base: str | None

    @classmethod
    def of(cls, model: ir.Model) -> "Portable":
        base = next(iter(graph.external_data(model).values()), None)
        proto, arrays = _proto_without_big_weights(model)
        return cls(proto, arrays, None if base is None else str(base))

    def load(self) -> ir.Model:
        """The model again; the arrays become its weights without a copy."""
        import onnx

        model = ir.from_proto(onnx.ModelProto.FromString(self.proto))
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                value.const_value = (
                    ir.tensor(self.arrays[name], name=name) if tensor.location == _IN_MEMORY
                    else ir.ExternalTensor(tensor.location, tensor.offset, tensor.length, tensor.dtype, shape=tensor.shape, name=name, base_dir=self.base or "")
                )
        return model


def on_cuda(sess: Session) -> bool:
    """True when the session's inputs belong on the GPU (its first provider is CUDA); where each node runs is `placement`."""
    return sess.get_providers()[0] == CUDA


def captures_graphs(sess: Session) -> bool:
    """Whether the session was made with Options.cuda_graph and runs on CUDA: its bound runs are captured and replayed."""
    return on_cuda(sess) and sess.get_provider_options().get(CUDA, {}).get("enable_cuda_graph") == "1"


def short_name(provider: str) -> str:
    """CUDAExecutionProvider -> CUDA."""
    return provider.removesuffix("ExecutionProvider")


@checkpointable
@dataclasses.dataclass(frozen=True)
class Placement:
    """Where ONNX Runtime ran a session's nodes (after its graph optimizations): the session's first provider,
    and the op types of the nodes it placed on the CPU instead, with their counts. On CUDA these are ops with no
    CUDA kernel for their types (an fp32 GroupQueryAttention has none) and the small shape computations ORT
    keeps on the host on purpose."""

    provider: str  # the session's first provider, e.g. CUDAExecutionProvider
    nodes: int  # distinct nodes that ran
    on_cpu: tuple[tuple[str, int], ...] = ()  # (op type, nodes) on CPUExecutionProvider when `provider` is another; most first

    def __str__(self) -> str:
        """`CUDA`, or `CUDA (CPU: GroupQueryAttention x4, Shape x2)`."""
        if not self.on_cpu:
            return short_name(self.provider)
        return f"{short_name(self.provider)} (CPU: {', '.join(f'{op} x{n}' for op, n in self.on_cpu)})"


def profile_events(sess: Session) -> list[dict] | None:
    """End the profile of `sess` (made with Options.profile) and read the events ORT wrote; None when the
    session does not profile or its profile has ended. Later runs of the session are not profiled."""
    if not sess.get_session_options().enable_profiling:
        return None
    written = sess.end_profiling()  # "" once ended: ORT writes a profile once
    return json.loads(Path(written).read_text()) if written else None


def placement_of(events: list[dict], provider: str) -> Placement:
    """The Placement that ORT's profile `events` show for a session whose first provider is `provider`.
    Each node that ran has one "Node" event "<node name>_kernel_time" per run, whose args give its op_name
    and provider; a node counts once however many runs the profile holds."""
    nodes: dict[str, tuple[str, str]] = {}
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            nodes[event["name"].removesuffix("_kernel_time")] = (event["args"]["provider"], event["args"]["op_name"])
    on_cpu = collections.Counter(op for where, op in nodes.values() if where == CPU) if provider != CPU else {}
    return Placement(provider, len(nodes), tuple(sorted(on_cpu.items(), key=lambda item: (-item[1], item[0]))))


def placement(sess: Session) -> Placement | None:
    """Where ORT ran the nodes of `sess`, from the profile of its runs so far (Options.profile; run it once
    first), which this ends; None for a session without a profile or with one already ended."""
    events = profile_events(sess)
    return None if events is None else placement_of(events, sess.get_providers()[0])


def feeds(
    sess: Session,
    input_ids: np.ndarray,
    past: dict[str, np.ndarray] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    mask: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Inputs for one forward pass of `input_ids` after an optional KV cache (`past`, by input name).

    Without `past` the cache is empty. mask: the attention mask over the cache and the new tokens, [batch, past + new]
    (zeros over cache positions a row does not own), each row's positions counted from its ones; without it the mask is
    all ones and positions continue after the cache. `extra` feeds inputs that surgery added itself (such as the scoring
    graph's targets).
    """
    extra = extra or {}
    batch, length = input_ids.shape
    past_len = 0 if not past else next(iter(past.values())).shape[2]
    out: dict[str, np.ndarray] = {}
    for arg in sess.get_inputs():
        if arg.name in extra:
            out[arg.name] = extra[arg.name]
        elif arg.name == "input_ids":
            out[arg.name] = input_ids.astype(np.int64)
        elif arg.name == "attention_mask":
            out[arg.name] = np.ones((batch, past_len + length), dtype=np.int64) if mask is None else mask
        elif arg.name == "position_ids" and mask is not None:
            out[arg.name] = np.cumsum(mask, axis=1)[:, past_len:] - 1
        elif arg.name == "position_ids":
            positions = np.arange(past_len, past_len + length, dtype=np.int64)
            out[arg.name] = np.broadcast_to(positions, (batch, length)).copy()
        elif arg.name.startswith("past_key_values"):
            if past:
                out[arg.name] = past[arg.name]
            else:
                heads, head_dim = arg.shape[1], arg.shape[3]
                if not (isinstance(heads, int) and isinstance(head_dim, int)) and getattr(sess, "kv_sizes", None):
                    heads, head_dim = sess.kv_sizes
                if not (isinstance(heads, int) and isinstance(head_dim, int)):
                    raise SurgeryError(
                        f"graph input {arg.name} {arg.shape} leaves the number of KV heads or the head size symbolic, so "
                        "surgery cannot make an empty KV cache for it; put the model's config.json (num_key_value_heads, "
                        "head_dim) or genai_config.json beside the .onnx file"
                    )
                out[arg.name] = zeros(arg, (batch, heads, 0, head_dim))
        else:
            raise SurgeryError(
                f"graph input {arg.name!r} is not one surgery can feed (input_ids, attention_mask, position_ids, "
                "past_key_values.*); export the model with `surgery export`"
            )
    return out


def element_type(arg) -> ir.DataType:
    """The float element type of a session input (an ORT NodeArg), from its type, not from a substring of its name."""
    dtype = ops.ORT_FLOATS.get(arg.type)
    if dtype is None:
        raise SurgeryError(f"graph input {arg.name!r} is {arg.type}; surgery feeds float, float16, bfloat16 or double tensors there")
    return dtype


def zeros(arg, shape: tuple[int, ...]):
    """Zeros of a session input's float type: an array, or an OrtValue for bfloat16 (numpy has no bfloat16 ORT reads)."""
    dtype = element_type(arg)
    if dtype == ir.DataType.BFLOAT16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.zeros(shape, np.uint16), int(dtype))
    return np.zeros(shape, dtype=dtype.numpy())


MALLOPT = ((-1, 2**31 - 1), (-3, 2**30), (-2, 2**28))  # glibc's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_TOP_PAD


def keep_freed_memory() -> None:
    """Ask glibc to keep the memory this process frees for its next allocations (no trimming; blocks under 1 GiB from its
    heap, not fresh mappings) instead of handing it back and faulting it in again. Task scoring frees and allocates KV
    caches of hundreds of MB a batch; on a 2-core VM the page faults took a third of a first pass (4.4 of 12.5 s on
    SmolLM2's arc_easy, 100 documents). Process-wide, so the command line calls it, not the library; a no-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    for option, value in MALLOPT:
        libc.mallopt(option, value)


def has_kv_cache(sess: Session) -> bool:
    return any(arg.name.startswith("past_key_values") for arg in sess.get_inputs())


def present_as_past(sess: Session, outputs: list[np.ndarray], names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Map a run's present.N.key/value outputs to the past_key_values.N.key/value inputs of the next run. names: the
    outputs' names when the run fetched only some (default: every output of the session, in order)."""
    names = names or [o.name for o in sess.get_outputs()]
    return {
        name.replace("present", "past_key_values", 1): value
        for name, value in zip(names, outputs)
        if name.startswith("present")
    }


Feed = np.ndarray | ort.OrtValue


class Prepared:
    """A run with its inputs already placed where the session runs; call it to run, outputs() for what it gave.

    bind: IO binding, inputs placed on the session's device once (here) and outputs left there, so a
    call copies nothing to or from the host. None binds when the session is on CUDA; True binds on
    CPU too (host buffers: the same code path, testable without a GPU); False runs sess.run.
    Inputs may be OrtValues already on the device, such as a bound run's present (decode_inputs).
    graph: the CUDA graph id of this run in a session made with Options.cuda_graph (each input shape
    needs its own). A captured graph reads and writes fixed addresses, so the run is bound (on CPU too,
    where the id is ignored) and its outputs go to buffers allocated once, at the shapes of a first run
    made here outside any graph; ORT captures the graph at a later call and replays it after.
    """

    def __init__(self, sess: Session, inputs: dict[str, Feed], bind: bool | None = None, graph: int | None = None):
        self.sess, self.inputs = sess, inputs
        self.device = "cuda" if on_cuda(sess) else "cpu"
        self.binding, self._outputs, self.run_options = None, None, None
        self._fixed: list | None = None  # with a graph id: the outputs' shapes and types, bound to buffers allocated once
        if bind or graph is not None or (bind is None and self.device == "cuda"):
            # the OrtValues are kept: a CPU one borrows its array's buffer, which must outlive the binding
            self.inputs = {
                name: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), self.device, 0)
                for name, v in inputs.items()
            }
            self.binding = sess.io_binding()
            for name, value in self.inputs.items():
                self.binding.bind_ortvalue_input(name, value)
            self._bind_outputs()
        if graph is not None:
            self.run_options = _graph_id(-1)  # this run outside any graph: the outputs' shapes
            self()
            self._fixed = [(v.shape(), v.element_type()) for v in self.binding.get_outputs()]  # ONNX type ints: bfloat16 too
            self._outputs = self.binding.get_outputs()  # the first run's, until the next call
            self._bind_outputs()
            self.run_options = _graph_id(graph)

    def _bind_outputs(self) -> None:
        self.binding.clear_binding_outputs()
        if self._fixed is None:
            for out in self.sess.get_outputs():
                self.binding.bind_output(out.name, self.device, 0)
            return
        for out, (shape, element_type) in zip(self.sess.get_outputs(), self._fixed, strict=True):
            buffer = ort.OrtValue.ortvalue_from_shape_and_type(shape, element_type, self.device, 0)
            self.binding.bind_ortvalue_output(out.name, buffer)

    def __call__(self) -> None:
        if self.binding is None:
            self._outputs = self.sess.run(None, self.inputs)
            return
        self.sess.run_with_iobinding(self.binding, self.run_options)
        self.binding.synchronize_outputs()
        if self._fixed is not None:
            self._outputs = None

    def outputs(self, keep: bool = False) -> list[Feed]:
        """The last call's outputs, in the order of sess.get_outputs(): OrtValues left on the device when
        bound, else arrays. A bound run writes its next outputs into the same buffers; keep=True hands
        these over for good (the next call gets new ones), so they can be another run's inputs: with a
        graph id, only before the graph is captured (the first two calls), as it keeps its addresses."""
        if self.binding is None:
            return list(self._outputs)
        values = self._outputs if self._outputs is not None else self.binding.get_outputs()
        if keep:
            self._outputs = None
            self._bind_outputs()
        return values


def _graph_id(graph: int) -> ort.RunOptions:
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph))
    return options


def decode_inputs(prefill: Prepared, next_ids: np.ndarray) -> dict[str, Feed]:
    """Inputs of the one-token step after `prefill` has run: its present as the past, left where it lies
    (on the device when `prefill` is bound: no host copy), the mask and positions one step on."""
    past = present_as_past(prefill.sess, prefill.outputs(keep=True))
    # feeds reads only the cache length from the past: zero-copy stand-ins of the right shape
    stand_ins = {
        name: np.broadcast_to(np.zeros((), np.float32), v.shape() if isinstance(v, ort.OrtValue) else v.shape)
        for name, v in past.items()
    }
    return {**feeds(prefill.sess, next_ids, stand_ins), **past}


def vocab_size(sess: Session) -> int:
    """The fixed last dimension of the `logits` output."""
    for out in sess.get_outputs():
        if out.name == "logits" and isinstance(out.shape[-1], int):
            return out.shape[-1]
    raise SurgeryError("the graph has no `logits` output with a fixed vocabulary size; evaluate needs a causal LM from `surgery export`")
