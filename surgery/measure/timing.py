"""latency() and branch_times() of ONNX graphs on ONNX Runtime -> dataclasses: wall times of prefill and decode with
the graphs' repeats interleaved, and each block's attention and mlp kernel times from a profile. Never prints."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from surgery.engine import runtime
from surgery.engine.progress import Step
from surgery.errors import SurgeryError
from surgery.files import config, graph
from surgery.files.checkpoint import checkpointable


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
    provider: str  # the session's first provider
    placement: runtime.Placement | None = None  # where ORT ran its nodes; None for a session handed over without a profile


@dataclasses.dataclass(frozen=True)
class LatencySettings:
    """Whether and how to time prefill and decode: `--latency`, `--repeats`, `--latency-batch`, `--warmup`."""

    measure: bool = True
    repeats: int = 20  # timed runs of each graph, interleaved across graphs
    batch: int = 1  # sequences per run
    warmup: int = 3  # untimed runs of each graph first


def latency(
    models: Sequence[ir.Model | str | Path | runtime.Session],
    *,
    batch: int = 1,
    seq_len: int = 256,
    repeats: int = 20,
    warmup: int = 3,
    options: runtime.Options = runtime.Options(),
    seed: int = 0,
    bind: bool | None = None,
    graphs: bool | None = None,
    progress: Step | None = None,
) -> list[Latency]:
    """Prefill and decode wall times of each model, with the repeats of all models interleaved.

    Each repeat runs every model's prefill, then every model's decode, starting from a different model each time, so drift on the machine falls on all graphs
    alike. Same session options for all (sessions given ready-made are used as they are). bind: IO binding, as runtime.Prepared (None: on CUDA); the decode's
    past is then the prefill's present, left on the device. The warm-up (at least one run) is profiled, for each session's placement; the timed runs are not. A
    session given ready-made has its placement read when it was made with Options.profile and not yet ended. graphs: each session's
    prefill and decode as CUDA graphs 1 and 2, on fixed buffers (runtime.Prepared); None: when the sessions capture graphs
    (Options.cuda_graph on CUDA); True on the CPU runs the same fixed-buffer path without a graph.
    """
    with tempfile.TemporaryDirectory() as tmp:
        sessions = [
            m if isinstance(m, runtime.Session)  # a session capturing CUDA graphs is not profiled as well: no placement
            else runtime.session(m, dataclasses.replace(options, profile=None if options.cuda_graph else str(Path(tmp) / f"{i}")))
            for i, m in enumerate(models)
        ]
        replay = [runtime.captures_graphs(s) if graphs is None else graphs for s in sessions]
        prefill, decode, placements = _warm(sessions, batch, seq_len, max(warmup, 1), seed, bind, replay)
    times = dict(zip(("prefill", "decode"), interleaved([prefill, decode], repeats, progress)))
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
                placement=placements[i],
            )
        )
    return results


def interleaved(runs: Sequence[Sequence[Callable[[], None] | None]], repeats: int, progress: Step | None = None) -> list[list[list[float]]]:
    """Wall times in ms, [kind][i][repeat], of runs[kind][i] (None: not run, no times). Each repeat runs every run of each
    kind in turn, kind after kind, starting from a different i each time, so drift on the machine falls on all alike."""
    times: list[list[list[float]]] = [[[] for _ in kind] for kind in runs]
    for r in range(repeats):
        for kind, per_kind in zip(runs, times):
            n = len(kind)
            for i in ((r + j) % n for j in range(n)):
                if kind[i] is None:
                    continue
                start = time.perf_counter()
                kind[i]()
                per_kind[i].append((time.perf_counter() - start) * 1000)
        if progress:
            progress(1)
    return times


def _warm(sessions, batch: int, seq_len: int, warmup: int, seed: int, bind: bool | None, replay: list[bool]):
    """Each session's prefill and decode runs (decode None without a KV cache; CUDA graphs 1 and 2 where `replay`),
    run `warmup` times each (a graph is captured at its second run), and each session's placement from the profile of those runs."""
    rng = np.random.default_rng(seed)
    vocab = runtime.vocab_size(sessions[0])
    ids = rng.integers(0, vocab, size=(batch, seq_len))
    next_ids = rng.integers(0, vocab, size=(batch, 1))
    prefill, decode = [], []
    for sess, graphs in zip(sessions, replay):
        prefill.append(runtime.Prepared(sess, runtime.feeds(sess, ids), bind, graph=1 if graphs else None))
        if runtime.has_kv_cache(sess):
            prefill[-1]()
            decode.append(runtime.Prepared(sess, runtime.decode_inputs(prefill[-1], next_ids), bind, graph=2 if graphs else None))
        else:
            decode.append(None)
    for run in prefill + [d for d in decode if d is not None]:
        for _ in range(max(warmup, 2) if run.run_options else warmup):  # a graph is captured at its second run
            run()
    return prefill, decode, [runtime.placement(sess) for sess in sessions]


@checkpointable
@dataclasses.dataclass(frozen=True)
class BranchTimes:
    """Per-block kernel time of the attention and mlp branches (ln included) in one prefill, ms."""

    attn_ms: tuple[float, ...]
    mlp_ms: tuple[float, ...]
    total_ms: float  # every kernel of the graph
    placement: runtime.Placement | None = None  # where the profiled session ran: the device of these times

    def estimated_speedup(self, layers) -> float:
        """The paper's estimate: a parallel block costs max(t_attn, t_mlp) instead of their sum."""
        saved = sum(min(self.attn_ms[l], self.mlp_ms[l]) for l in layers)
        return self.total_ms / (self.total_ms - saved)


def branch_times(
    model, *, batch: int = 1, seq_len: int = 256, runs: int = 5, seed: int = 0, options: runtime.Options = runtime.Options()
) -> BranchTimes:
    """Profile prefill with ONNX Runtime's profiler (basic optimisations keep node names) and add each node's kernel time to its block's branch. Nodes that
    several blocks share (mask, rotary) count only in the total. The session has `options` but for those two, so the times are on the device that latency() with
    the same options measures (CUDA when usable, for auto). On CUDA a node's time is what ORT's profiler records, the host side of its kernel (launch, and any
    wait on the device): ORT's pip build has no CUPTI for device times."""
    from surgery.model.blocks import branch_nodes
    from surgery.model.subject import Subject

    subject = Subject.of(model)
    model, blocks = subject.model, subject.blocks
    owner: dict[str, tuple[int, str] | None] = {}
    for block in blocks:
        for branch in ("attn", "mlp"):
            for node in branch_nodes(model, block, branch, subject.values):
                owner[node.name] = (block.layer, branch) if node.name not in owner else None
    with tempfile.TemporaryDirectory() as tmp:
        sess = runtime.session(model, dataclasses.replace(options, optimization="basic", profile=str(Path(tmp) / "profile")))
        ids = np.random.default_rng(seed).integers(0, runtime.vocab_size(sess), size=(batch, seq_len))
        inputs = runtime.feeds(sess, ids)
        for _ in range(runs):
            sess.run(None, inputs)
        events = runtime.profile_events(sess)
    attn, mlp, total = np.zeros(len(blocks)), np.zeros(len(blocks)), 0.0
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        ms = event["dur"] / 1000 / runs
        total += ms
        where = owner.get(event["name"][: -len("_kernel_time")])
        if where is not None:
            (attn if where[1] == "attn" else mlp)[where[0]] += ms
    return BranchTimes(tuple(attn.tolist()), tuple(mlp.tolist()), total, runtime.placement_of(events, sess.get_providers()[0]))


def check_seq_len(model: str | Path, seq_len: int, decode: bool = True) -> None:
    """Refuse a window longer than the model's position limit (decode needs seq_len + 1 positions)."""
    limit = config.position_limit(graph.resolve(model).parent)
    needed = seq_len + 1 if decode else seq_len
    if limit is not None and needed > limit:
        raise SurgeryError(
            f"--seq-len {seq_len} is beyond the model's position limit {limit} (config.json or genai_config.json"
            f"{'; decode needs seq-len + 1' if decode else ''}); choose --seq-len {limit - 1 if decode else limit} or less"
        )
