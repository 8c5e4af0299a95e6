"""perplexity() and latency() of ONNX graphs on ONNX Runtime -> dataclasses. Never prints."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery import graph, runtime
from surgery.data import Windows
from surgery.errors import SurgeryError

TARGETS, NLL = "surgery_targets", "surgery_nll"
Progress = Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class Perplexity:
    loss: float  # token-weighted mean NLL, nats
    perplexity: float
    tokens: int
    windows: int
    seconds: float
    window_nll: tuple[float, ...] = ()  # summed NLL of each window's scored targets, for paired intervals
    window_tokens: tuple[int, ...] = ()


def joined(parts: Sequence[Perplexity]) -> Perplexity:
    """The Perplexity of all the windows of `parts`, in order, each part scored on its own windows."""
    sums = [s for p in parts for s in p.window_nll]
    counts = [c for p in parts for c in p.window_tokens]
    loss = sum(sums) / sum(counts)
    return Perplexity(
        loss, math.exp(loss), sum(counts), sum(p.windows for p in parts), sum(p.seconds for p in parts), tuple(sums), tuple(counts)
    )


@dataclasses.dataclass(frozen=True)
class Delta:
    """dNLL = loss(other) - loss(base) on the same windows, with a 95 % paired bootstrap interval over windows."""

    dnll: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.dnll:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"

    def to_json(self) -> dict:
        return {"dnll": self.dnll, "low": self.low, "high": self.high}


def delta(base: Perplexity, other: Perplexity, *, resamples: int = 2000, seed: int = 0) -> Delta:
    """Paired bootstrap of dNLL over windows: resample windows with replacement, the same ones for both
    models, and take the 2.5 / 97.5 percentiles of the token-weighted difference."""
    if base.window_tokens != other.window_tokens:
        raise SurgeryError("dNLL needs both models scored on the same windows")
    diff = np.asarray(other.window_nll, np.float64) - np.asarray(base.window_nll, np.float64)
    tokens = np.asarray(base.window_tokens, np.float64)
    point = float(diff.sum() / tokens.sum())
    if len(diff) < 2:
        return Delta(point, point, point)
    picks = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))
    samples = diff[picks].sum(1) / tokens[picks].sum(1)
    low, high = np.percentile(samples, [2.5, 97.5])
    return Delta(point, float(low), float(high))


@dataclasses.dataclass(frozen=True)
class Latency:
    """Median and p90 wall times of one graph, from runs interleaved with the other graphs compared."""

    prefill_ms: float  # one forward pass of batch x seq_len tokens, empty KV cache
    prefill_p90_ms: float
    decode_ms: float | None  # one new token per sequence after a KV cache of seq_len; None without a cache
    decode_p90_ms: float | None
    batch: int
    seq_len: int
    repeats: int
    provider: str


def scoring_model(model: ir.Model, keep: Sequence[str] = ()) -> ir.Model:
    """A copy of `model` that takes `surgery_targets` [batch, seq] and outputs only `surgery_nll` [batch, seq]:
    -log softmax(logits)[target], so only one number per token leaves the session; then the outputs named in `keep`."""
    model = model.clone()
    g = model.graph
    logits = next((v for v in g.outputs if v.name == "logits"), None)
    if logits is None:
        names = ", ".join(v.name for v in g.outputs)
        raise SurgeryError(f"the graph has no `logits` output (it has {names}); evaluate needs a causal LM from `surgery export`")
    targets = ir.Value(name=TARGETS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch_size", "sequence_length"]))
    axis = ir.Value(name="surgery/evaluate/last_axis", const_value=ir.tensor(np.array([-1], np.int64), name="surgery/evaluate/last_axis"))
    g.register_initializer(axis)
    scores = logits
    nodes = []
    if logits.dtype not in (None, ir.DataType.FLOAT):
        nodes.append(ir.node("Cast", [logits], attributes={"to": ir.DataType.FLOAT}))
        scores = nodes[-1].outputs[0]
    nodes.append(ir.node("LogSoftmax", [scores], attributes={"axis": -1}))
    nodes.append(ir.node("Unsqueeze", [targets, axis]))
    nodes.append(ir.node("GatherElements", [nodes[-2].outputs[0], nodes[-1].outputs[0]], attributes={"axis": -1}))
    nodes.append(ir.node("Squeeze", [nodes[-1].outputs[0], axis]))
    nodes.append(ir.node("Neg", [nodes[-1].outputs[0]]))
    for i, node in enumerate(nodes):
        node.name = node.outputs[0].name = f"surgery/evaluate/{i}_{node.op_type}"
    nll = nodes[-1].outputs[0]
    nll.name, nll.dtype, nll.shape = NLL, ir.DataType.FLOAT, ir.Shape(["batch_size", "sequence_length"])
    g.extend(nodes)
    g.inputs.append(targets)
    kept = [v for name in keep for v in g.outputs if v.name == name]
    g.outputs.clear()
    g.outputs.extend([nll, *kept])
    RemoveUnusedNodesPass()(model)  # drops the KV cache outputs' own nodes
    return model


class Scorer:
    """One session that scores token windows under a model; reuse it for many windows or switch settings.
    keep: outputs of `model` that a call can also hand back (see `kept`)."""

    def __init__(self, model: ir.Model | str | Path, options: runtime.Options = runtime.Options(), keep: Sequence[str] = ()):
        if not isinstance(model, ir.Model):
            model = graph.load(model)
        self.keep = tuple(keep)
        self.session = runtime.session(scoring_model(model, self.keep), options)

    def __call__(
        self,
        windows: Windows,
        *,
        batch_size: int = 1,
        extra: dict[str, np.ndarray] | None = None,
        progress: Progress | None = None,
        kept: dict[str, np.ndarray] | None = None,
    ) -> Perplexity:
        """Token-weighted mean NLL (nats) of `windows`; `extra` feeds inputs a diagnostic graph added.
        `kept`, when given, receives the `keep` outputs of the last batch, by name."""
        start = time.perf_counter()
        sums, counts = [], []
        positions = np.arange(windows.seq_len)
        for lo in range(0, len(windows), batch_size):
            ids = windows.ids[lo : lo + batch_size]
            targets = np.zeros_like(ids)
            targets[:, :-1] = ids[:, 1:]  # position t predicts token t + 1; the last position predicts nothing
            feed = runtime.feeds(self.session, ids, extra={TARGETS: targets, **(extra or {})})
            nll, *outputs = self.session.run([NLL, *(self.keep if kept is not None else ())], feed)
            if kept is not None:
                kept.update(zip(self.keep, outputs))
            first = windows.score_from[lo : lo + batch_size, None]
            scored = (positions[None, :] >= first) & (positions[None, :] < windows.seq_len - 1)
            sums += [float(s) for s in np.where(scored, nll, 0).astype(np.float64).sum(1)]
            counts += [int(c) for c in scored.sum(1)]
            if progress:
                progress(len(ids))
        loss = sum(sums) / sum(counts)
        return Perplexity(loss, math.exp(loss), sum(counts), len(windows), time.perf_counter() - start, tuple(sums), tuple(counts))


def perplexity(
    model: ir.Model | str | Path,
    windows: Windows,
    *,
    batch_size: int = 1,
    options: runtime.Options = runtime.Options(),
    progress: Progress | None = None,
) -> Perplexity:
    """Token-weighted mean NLL (nats) of `windows` under `model`, computed by ONNX Runtime."""
    return Scorer(model, options)(windows, batch_size=batch_size, progress=progress)


def latency(
    models: Sequence[ir.Model | str | Path | ort.InferenceSession],
    *,
    batch: int = 1,
    seq_len: int = 256,
    repeats: int = 20,
    warmup: int = 3,
    options: runtime.Options = runtime.Options(),
    seed: int = 0,
    bind: bool | None = None,
    progress: Progress | None = None,
) -> list[Latency]:
    """Prefill and decode wall times of each model, with the repeats of all models interleaved.

    Each repeat runs every model's prefill, then every model's decode, starting from a different
    model each time, so drift on the machine falls on all graphs alike. Same session options for all
    (sessions given ready-made are used as they are). bind: IO binding, as runtime.Prepared (None:
    on CUDA); the decode's past is then the prefill's present, left on the device.
    """
    sessions = [m if isinstance(m, ort.InferenceSession) else runtime.session(m, options) for m in models]
    rng = np.random.default_rng(seed)
    vocab = runtime.vocab_size(sessions[0])
    ids = rng.integers(0, vocab, size=(batch, seq_len))
    next_ids = rng.integers(0, vocab, size=(batch, 1))
    prefill, decode = [], []
    for sess in sessions:
        prefill.append(runtime.Prepared(sess, runtime.feeds(sess, ids), bind))
        if runtime.has_kv_cache(sess):
            prefill[-1]()
            decode.append(runtime.Prepared(sess, runtime.decode_inputs(prefill[-1], next_ids), bind))
        else:
            decode.append(None)
    for run in prefill + [d for d in decode if d is not None]:
        for _ in range(warmup):
            run()
    times = {kind: [[] for _ in sessions] for kind in ("prefill", "decode")}
    n = len(sessions)
    for r in range(repeats):
        order = [(r + i) % n for i in range(n)]
        for kind, runs in (("prefill", prefill), ("decode", decode)):
            for i in order:
                if runs[i] is None:
                    continue
                start = time.perf_counter()
                runs[i]()
                times[kind][i].append((time.perf_counter() - start) * 1000)
        if progress:
            progress(1)
    results = []
    for i, sess in enumerate(sessions):
        p, d = times["prefill"][i], times["decode"][i]
        results.append(
            Latency(
                prefill_ms=float(np.median(p)),
                prefill_p90_ms=float(np.percentile(p, 90)),
                decode_ms=float(np.median(d)) if d else None,
                decode_p90_ms=float(np.percentile(d, 90)) if d else None,
                batch=batch,
                seq_len=seq_len,
                repeats=repeats,
                provider=sess.get_providers()[0],
            )
        )
    return results


@dataclasses.dataclass(frozen=True)
class BranchTimes:
    """Per-block kernel time of the attention and mlp branches (ln included) in one prefill, ms."""

    attn_ms: tuple[float, ...]
    mlp_ms: tuple[float, ...]
    total_ms: float  # every kernel of the graph

    def estimated_speedup(self, layers) -> float:
        """The paper's estimate: a parallel block costs max(t_attn, t_mlp) instead of their sum."""
        saved = sum(min(self.attn_ms[l], self.mlp_ms[l]) for l in layers)
        return self.total_ms / (self.total_ms - saved)


def branch_times(model: ir.Model, *, batch: int = 1, seq_len: int = 256, runs: int = 5, seed: int = 0) -> BranchTimes:
    """Profile prefill with ONNX Runtime's profiler (basic optimisations keep node names) and add each
    node's kernel time to its block's branch. Nodes that several blocks share (mask, rotary) count
    only in the total."""
    import os
    import tempfile

    from surgery.blocks import branch_nodes, find_blocks

    blocks = find_blocks(model)
    owner: dict[str, tuple[int, str] | None] = {}
    for block in blocks:
        for branch in ("attn", "mlp"):
            for node in branch_nodes(model, block, branch):
                owner[node.name] = (block.layer, branch) if node.name not in owner else None
    with tempfile.TemporaryDirectory() as tmp:
        options = runtime.Options(optimization="basic", device="cpu", profile=os.path.join(tmp, "profile"))
        sess = runtime.session(model, options)
        ids = np.random.default_rng(seed).integers(0, runtime.vocab_size(sess), size=(batch, seq_len))
        inputs = runtime.feeds(sess, ids)
        for _ in range(runs):
            sess.run(None, inputs)
        events = json.loads(Path(sess.end_profiling()).read_text())
    attn, mlp, total = np.zeros(len(blocks)), np.zeros(len(blocks)), 0.0
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        ms = event["dur"] / 1000 / runs
        total += ms
        where = owner.get(event["name"][: -len("_kernel_time")])
        if where is not None:
            (attn if where[1] == "attn" else mlp)[where[0]] += ms
    return BranchTimes(tuple(attn.tolist()), tuple(mlp.tolist()), total)


def check_seq_len(model: str | Path, seq_len: int, decode: bool = True) -> None:
    """Refuse a window longer than the model's position limit (decode needs seq_len + 1 positions)."""
    limit = position_limit(model)
    needed = seq_len + 1 if decode else seq_len
    if limit is not None and needed > limit:
        raise SurgeryError(
            f"--seq-len {seq_len} is beyond the model's position limit {limit} (config.json or genai_config.json"
            f"{'; decode needs seq-len + 1' if decode else ''}); choose --seq-len {limit - 1 if decode else limit} or less"
        )


def position_limit(model: str | Path) -> int | None:
    """The model's position limit from config.json beside it (max_position_embeddings or n_positions), or
    from genai_config.json (model.context_length) in a GenAI builder folder."""
    folder = graph.resolve(model).parent
    for name, keys in (("config.json", ("max_position_embeddings", "n_positions")), ("genai_config.json", ("context_length",))):
        try:
            data = json.loads((folder / name).read_text())
        except (json.JSONDecodeError, OSError):
            continue
        data = data.get("model", {}) if name == "genai_config.json" else data
        for key in keys:
            if isinstance(data.get(key), int):
                return data[key]
    return None

