"""What the main job and diagnose cost, as functions of the model's shape and the job's windows: FLOPs, bytes
moved, memory and seconds, from a few rates measured on this machine.

    python benchmarks/cost.py                                   # measure the rates, project 135M, 1.1B, 8B, 70B
    python benchmarks/cost.py --shapes smollm2-135m,llama-3-8b  # only these shapes (names in SHAPES below)
    python benchmarks/cost.py --validate SHAPE:LAYERS:RUN ...   # predicted vs measured, one row per part of each run
    python benchmarks/cost.py --run KIND:SHAPE:LAYERS:MODEL ... --runs out/cost-runs   # the same, interleaved

--run makes each run itself (KIND parallelize or diagnose, with each command's defaults and --no-latency) under
`/usr/bin/time -v`, and measures the shape's rates right before and right after it: each run is predicted from the
mean of its two measurements, and the table says how far they moved. This host's speed drifts by more than the
30 % the check allows between one quarter of an hour and the next, so only interleaved rates mean anything.

RUN is the output folder of `surgery parallelize` (its selection.json) or of `surgery diagnose` (report.json),
with the `/usr/bin/time -v` log of the command beside it as RUN.time (wall time and peak RSS); SHAPE is a name
in SHAPES (synthetic-2048 is graphs/big_decoder.py's) and LAYERS its number of blocks.

The model counts what the code does (surgery/compensation/fitting.py, select.py, trials.py, diagnostics/diagnose.py):
- fit: each pass runs only its own blocks (from the stream the pass before handed on), so the forward passes of
  all passes together are one pass of every block, each block's mlp twice (the twin), no head, over the fit
  windows; per window and block the float32 products Z'Z (k = 2 d + 1: syrk, n k^2) and Z'delta (2 n k d) are
  added to float64 sums; per block the ridge choice (one symmetric eigendecomposition of k^2, two k^3 products)
  and one LU solve with d right-hand sides. The fix's input side (the default) adds, before each chunk's pass, a
  pass of the same blocks without the twin, whose sums ([u, 1]: k_in = d + 1) cost (d + 1) / (3 d + 1) of the
  output side's per window and whose solve (k_in / k)^3 of its.
- selection: the switchboard scored on the selection windows once per trial and once for the baseline: the head
  and the log-softmax, and the blocks from where the run starts; each compensated block's switch copies W_o and
  W_down (Where). A trial resumes at its block from the accepted set's stream (trials.Trials): the share of the
  blocks the runs make is the run's own (selection.json's blocks_run) where there is one, else modelled as the
  baseline's whole pass and trials starting at blocks spread evenly over the model ((L + 1) / 2 blocks each).
- evaluation: the original and the rewritten model on the evaluation windows; write: the weights once.
- diagnose: the probe (per calibration window: every block as the one-block decoder's probe measured, and the
  head), the loss runs (per evaluation window: the baseline, then 7 switch kinds at each block alone, each run
  resuming at its block, and 10 all-layer runs), prefix sensitivity (per window one batch: the window and a
  perturbed copy per distance) and the critical points (per block 200 fixed-point steps, each streaming the mlp's
  weights once for 4 seeds, and per zero found a forward-difference Jacobian of d mlp evaluations).

Seconds come from rates measured here on one block of each shape (Rates.measure): ONNX Runtime's forward of a
one-block decoder of the shape on 256 tokens; the code's own runs of that decoder: a selection trial (its
switchboard with a fix, scored as select scores trials: trials.BATCH windows a run, against a reference),
diagnose's probe, loss runs and prefix sensitivity; the scored head (the MatMul, then scoring.scoring_model's
LogSoftmax, NLL, argmax and KL against a reference) on a slice of the vocabulary; the marginal cost of one
window's accumulation of one layer's sums in the fit's own Accumulator (at d_model up to 4096, scaled by k^2
above); one layer's solve (at d_model up to 1024, scaled by k^3); a session's setup per weight byte; the memory
bandwidth. Memory adds what each stage holds: the weight copies of the loaded model and of each session after one
run on 256 tokens (measured in a fresh process on one- and two-block models, with the weights on external data and
inside the .onnx file: the difference is per block, the rest the session's fixed bytes), the fit pass's sums, the
fixes, the switchboard's folded weights and the reference log-probs. Nothing is fitted to the runs it is checked
against. The GPU projection assumes an H200-class device (GPU below): the forward passes run there, and the fit's
sums and solves stay on the host CPU, as the code runs them today.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import ROOT, table

sys.path.insert(0, str(ROOT))

SHAPES = {  # d_model, heads, kv heads, d_mlp, vocab (config.json of each)
    "smollm2-135m": dict(d=576, heads=9, kv=3, mlp=1536, vocab=49152),
    "synthetic-2048": dict(d=2048, heads=32, kv=4, mlp=5632, vocab=32000),  # graphs/big_decoder.py (TinyLlama-1.1B)
    "llama-3-8b": dict(d=4096, heads=32, kv=8, mlp=14336, vocab=128256),
    "llama-3-70b": dict(d=8192, heads=64, kv=8, mlp=28672, vocab=128256),
}
LAYERS = {"smollm2-135m": 30, "synthetic-2048": 22, "llama-3-8b": 32, "llama-3-70b": 80}
# An H200-class GPU, assumed: ORT's fp32 MatMuls at half of 67 TFLOP/s (no TF32), 4.8 TB/s HBM, 141 GB.
GPU = dict(name="H200-class (assumed)", flops=33e12, bandwidth=4.8e12, memory=141e9)


@dataclasses.dataclass(frozen=True)
class Job:
    """The main job's and diagnose's windows (their defaults) and how many selection trials ran."""

    tokens: int = 256
    fit_windows: int = 64
    selection_windows: int = 16
    eval_windows: int = 8
    trials: int | None = None  # None: one per block (every candidate tried)
    blocks_share: float | None = None  # of the selection runs' blocks, the share run (resumed trials); None: modelled
    input_side: bool = True  # the fix's input side: one more fit pass, without the twin
    compensated: int | None = None  # blocks with a fix, whose switch the trials' graph holds (None: all)
    diag_windows: int = 4
    diag_eval_windows: int = 4
    zeros: int | None = None  # critical points found per block (None: one per seed, 4)
    fit_memory: int | None = None  # --fit-memory bytes (None: auto, a quarter of the memory available here now)
    inline: bool | None = None  # weights inside the .onnx file (None: under 2 GB, as exporters write them)


@dataclasses.dataclass(frozen=True)
class Shape:
    d: int
    heads: int
    kv: int
    mlp: int
    vocab: int
    layers: int

    @property
    def d_kv(self) -> int:
        return self.d // self.heads * self.kv

    @property
    def k(self) -> int:
        return 2 * self.d + 1  # the fit's features [A, P, 1]

    def block_params(self) -> int:
        return 2 * self.d * self.d + 2 * self.d * self.d_kv + 3 * self.d * self.mlp

    def weight_bytes(self) -> int:
        """float32, embedding and head untied (tied models store one table: less)."""
        return 4 * (self.layers * self.block_params() + 2 * self.vocab * self.d)

    def block_flops(self, tokens: int, twin: bool = False) -> float:
        """One block on `tokens` tokens of prefill: projections, mlp (twice with the twin), the T^2 attention."""
        per_token = 2 * self.block_params() + 4 * tokens * self.d + (6 * self.d * self.mlp if twin else 0)
        return per_token * tokens

    def head_flops(self, tokens: int) -> float:
        return 2 * self.d * self.vocab * tokens


@dataclasses.dataclass(frozen=True)
class Rates:
    """What this machine does at one shape, measured (`measure`): seconds of ONNX Runtime's forward of one block
    and of the head on 256 tokens, of one window's update of one layer's normal equations, of one layer's solve,
    and the memory bandwidth."""

    block: float  # one block's forward, 256 tokens (measured on a one-block decoder of the shape)
    head: float  # the scored head: MatMul, LogSoftmax and the KL against a reference, 256 tokens
    update: float  # one window's accumulation of one layer's sums in the fit's own Accumulator, 255 tokens (at d_model min(d, 4096), scaled by k^2)
    solve: float  # NormalEquations.solve (measured at d_model min(d, 1024), scaled by k^3)
    bandwidth: float  # bytes/s of a float64 add (read two, write one)
    write: float  # bytes/s written to disk
    setup: float  # seconds per weight byte to make a session (graph, weights, ORT's optimizations)
    external: tuple[float, float, float]  # weights on external data: resident copies after graph.load, after a session of it; the session's fixed bytes
    inline: tuple[float, float, float] | None  # the same for weights inside the .onnx file (None: the shape's block is over 512 MiB)
    probe: float  # diagnose's probe of one 256-token window through one block: twin mlp, in-graph statistics, ranks
    trial: float  # a selection trial's block per window: the one-block switchboard scored as select scores it (BATCH windows a run, compensated on)
    loss: float  # a block of diagnose's loss runs, per window: its switchboard of every kind, scored against the unchanged run, resumed
    prefix: float  # a block of diagnose's prefix sensitivity, per row of its batch (a window's batch: it and a copy per distance)

    def copies(self, inline: bool) -> tuple[float, float, float]:
        return self.inline if inline and self.inline is not None else self.external

    @classmethod
    def measure(cls, s: Shape, scratch: Path) -> Rates:
        from graphs import big_decoder
        from surgery.compensation.equations import NormalEquations
        from surgery.engine import runtime
        from surgery.files import graph

        rng = np.random.default_rng(0)
        t = 256
        folder = scratch / f"block-{s.d}"
        shape = dict(d_model=s.d, n_heads=s.heads, n_kv_heads=s.kv, d_mlp=s.mlp, vocab=512, max_pos=t)
        big_decoder.write(folder, 1, shape=shape)  # one block, the fixtures tokenizer's 512-token vocabulary: the head is negligible
        start = time.perf_counter()
        sess = runtime.session(graph.resolve(folder))
        setup = (time.perf_counter() - start) / (4 * s.block_params())
        feed = runtime.feeds(sess, rng.integers(0, 512, (1, t)))
        block = _seconds(lambda: sess.run(["logits"], feed), 5)
        from surgery.diagnostics import DiagnoseSettings, diagnose
        from surgery.engine.cluster import Resources
        from surgery.text.data import DataSettings

        # diagnose's own probe, loss runs and prefix sensitivity on the one-block decoder (its head: 512 tokens, negligible)
        n_cal, n_eval, only = 3, 2, ("deficit", "diversity", "defect", "gate", "ablation", "prefix")
        settings = DiagnoseSettings(DataSettings(seq_len=t), windows=n_cal, eval_windows=n_eval, only=only)
        report = diagnose(folder, settings, Resources(runtime.analysis(runtime.Options()))).to_json()
        probe = (report["seconds"]["probe"] - report["seconds"]["probe_setup"]) / n_cal  # diagnose's probe of one window, one block
        loss = report["seconds"]["losses"] / (n_eval * _loss_blocks(1))
        prefix = report["seconds"]["prefix"] / (n_cal * _prefix_runs(t))
        block_bytes = 4 * s.block_params()
        two = scratch / f"blocks-{s.d}"
        big_decoder.write(two, 2, shape=shape)
        external = _copies(graph.resolve(folder), graph.resolve(two), block_bytes)
        inline = None
        if block_bytes < 1 << 29:  # models under protobuf's 2 GB limit are exported with their weights inline
            import onnx

            for f in (folder, two):
                onnx.save(onnx.load(graph.resolve(f)), f / "inline.onnx")
            inline = _copies(folder / "inline.onnx", two / "inline.onnx", block_bytes)
        shutil.rmtree(two)
        head = _head(rng, s.d, t) * s.vocab / HEAD_SLICE
        trial = _trial(graph.load(folder), rng, t)
        if s.d <= 4096:
            update = _update(graph.load(folder), rng, t)
        else:  # one layer's sums at d_model 8192 would take 6 GB: measured at 4096 and scaled by k^2
            narrow = scratch / "update-4096"
            big_decoder.write(narrow, 1, shape=dict(shape, d_model=4096, n_heads=32, n_kv_heads=8, d_mlp=14336))
            update = _update(graph.load(narrow), rng, t) * (s.k / 8193) ** 2
            shutil.rmtree(narrow)
        d = min(s.d, 1024)
        eq = NormalEquations(d)
        mix = rng.standard_normal((d, d)).astype(np.float32) / d**0.5
        for i in range(8):  # correlated features, a defect that depends on them: a solve like a real one
            a, p = (rng.standard_normal((t - 1, d)).astype(np.float32) for _ in range(2))
            eq.update(i % 2, a, p, (a + p) @ mix + 0.1 * rng.standard_normal((t - 1, d)).astype(np.float32), a + p)
        solve = _seconds(lambda: eq.solve(0), 1) * (s.k / (2 * d + 1)) ** 3
        big, other = np.zeros(1 << 24), np.ones(1 << 24)
        bandwidth = 3 * big.nbytes / _seconds(lambda: big.__iadd__(other), 10)
        shutil.rmtree(folder)
        return cls(block, head, update, solve, bandwidth, _write_rate(scratch), setup, external, inline, probe, trial, loss, prefix)


HEAD_SLICE = 8192  # the scored head is measured on a slice of the vocabulary, scaled to the whole


def _head(rng, d: int, t: int) -> float:
    """Seconds of the scored head on one window of t tokens and HEAD_SLICE of the vocabulary: the MatMul, then
    what scoring.scoring_model adds (LogSoftmax, the target's NLL, the argmax, the KL against a reference),
    fetched as a Scorer fetches them."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from surgery.engine import runtime
    from surgery.measure import scoring

    w = numpy_helper.from_array(rng.standard_normal((d, HEAD_SLICE)).astype(np.float32) / d**0.5, "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "head",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", "sequence_length", d])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", HEAD_SLICE])], [w])
    model = ir.from_proto(helper.make_model(g, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]))
    sess = runtime.session(scoring.scoring_model(model, compare=True))
    ref = np.log(np.full((1, t, HEAD_SLICE), 1.0 / HEAD_SLICE, np.float32))
    feed = {"x": rng.standard_normal((1, t, d)).astype(np.float32), scoring.TARGETS: np.zeros((1, t), np.int64), scoring.REFERENCE: ref}
    return _seconds(lambda: sess.run([scoring.NLL, scoring.TOP1, scoring.KL], feed), 5)


def _loss_blocks(layers: int) -> int:
    """Blocks diagnose's loss runs compute per window: the unchanged run, 7 kinds at each block alone (each
    resuming at its block) and 10 runs at every block."""
    return layers + 7 * sum(layers - layer for layer in range(layers)) + 10 * layers


def _prefix_runs(tokens: int) -> int:
    """Rows of diagnose's prefix batch per window: the window and one copy per distance."""
    from surgery.diagnostics import prefix

    return 1 + len(prefix.distances(tokens))


def _update(model, rng, t: int, windows: int = 8) -> float:
    """Seconds of one window's accumulation of one layer's sums, in the fit's own Accumulator (its session and
    options: ORT's threads idle between runs), on a one-block model: the marginal cost of a window, from a run
    of one window and a run of 1 + `windows` (the first window of a run also allocates and first touches the
    sums, which a fit over tens of windows pays once per layer)."""
    from surgery.analysis.fit_graph import fit_graph, switched
    from surgery.compensation.fitting import Accumulator
    from surgery.engine import runtime

    accumulator = Accumulator(fit_graph(model), runtime.Options(spinning=False))
    switches = switched(1)
    ids = rng.integers(0, 512, (1 + windows, t))
    accumulator.run([0], ids[:1], 0, switches)  # warm
    one = accumulator.run([0], ids[:1], 0, switches)[-1]["accumulate"]
    return (accumulator.run([0], ids, 0, switches)[-1]["accumulate"] - one) / windows


def _trial(model, rng, t: int) -> float:
    """Seconds per window of a selection trial's run of one block: the switchboard of the one-block model with a
    compensation fix, scored against a reference in batches of trials.BATCH windows, the block switched on."""
    from surgery.analysis import switchboard as board_graph
    from surgery.analysis.fit_graph import kinds, switched
    from surgery.engine import runtime
    from surgery.jobs.trials import BATCH
    from surgery.measure import scoring
    from surgery.model.embedding import embedding_table
    from surgery.passes import Fix
    from surgery.text.data import Windows

    d = embedding_table(model)[1]
    fix = Fix(w_a=0.01 * rng.standard_normal((d, d)), w_p=0.01 * rng.standard_normal((d, d)), b=np.zeros(d))
    scorer = scoring.Scorer(board_graph.switchboard(model, kinds({0: fix})), runtime.Options(), compare=True)
    windows = Windows(rng.integers(0, 512, (BATCH, t)), np.zeros(BATCH, np.int64), np.zeros(BATCH, np.int64), "random")
    reference: list = []
    scorer(windows, batch_size=BATCH, extra={board_graph.SWITCHES: switched(1)}, record=reference)
    on = {board_graph.SWITCHES: switched(1, {0: "compensated"})}
    return _seconds(lambda: scorer(windows, batch_size=BATCH, extra=on, reference=reference), 3) / BATCH


_COPIES = """
import sys
import numpy as np
from surgery.files import graph
from surgery.engine import runtime
from surgery.measure import scoring
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
start = rss()
model = graph.load(sys.argv[1])
loaded = rss()
session = runtime.session(model)
session.run(["logits"], runtime.feeds(session, np.ones((1, 256), np.int64)))
print(loaded - start, rss() - loaded)
"""


def _copies(one: Path, two: Path, block_bytes: int) -> tuple[float, float, float]:
    """Copies of the weights resident after graph.load and after a session of the loaded model and one run (each in a
    fresh process, as the main job makes its sessions), per weight byte from the 1- and 2-block models' difference,
    and the session's fixed bytes beside them."""
    import subprocess

    def resident(path: Path) -> tuple[int, int]:
        done = subprocess.run([sys.executable, "-c", _COPIES, str(path)], capture_output=True, text=True, check=True, cwd=ROOT)
        loaded, session = (int(x) for x in done.stdout.split())
        return loaded, session

    (load1, sess1), (load2, sess2) = resident(one), resident(two)
    loaded, session = (load2 - load1) / block_bytes, (sess2 - sess1) / block_bytes
    return max(loaded, 0.0), session, max(sess1 - session * block_bytes, 0.0)


def _seconds(f, repeats: int) -> float:
    """The median of `repeats` timed calls, after one untimed."""
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _write_rate(folder: Path, nbytes: int = 512 << 20) -> float:
    import os
    import tempfile

    block = np.random.default_rng(0).bytes(64 << 20)
    with tempfile.NamedTemporaryFile(dir=folder) as f:
        start = time.perf_counter()
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return nbytes / (time.perf_counter() - start)


def _scaled(r: Rates, s: Shape, job: Job, device: dict | None) -> tuple[float, float]:
    """Seconds of one block and of the head on job.tokens tokens, here or on the GPU (FLOPs at its rate)."""
    if device:
        return s.block_flops(job.tokens) / device["flops"], s.head_flops(job.tokens) / device["flops"]
    return r.block * s.block_flops(job.tokens) / s.block_flops(256), r.head * job.tokens / 256


def parallelize(s: Shape, job: Job, r: Rates, device: dict | None = None) -> dict:
    """FLOPs, bytes, seconds and memory of each part of the main job. device: a GPU for the forward passes."""
    block, head = _scaled(r, s, job, device)
    twin = s.block_flops(job.tokens, twin=True) / s.block_flops(job.tokens)
    k, n = s.k, job.tokens - 1
    trials = s.layers if job.trials is None else job.trials
    share = job.blocks_share if job.blocks_share is not None else (s.layers + trials * (s.layers + 1) / 2) / ((1 + trials) * s.layers)
    # with the input side, each fit part also does the input side's share of it: a pass without the twin, [u, 1] sums and solve
    forward, accumulate, solve = (1 + 1 / twin, 1 + (s.d + 1) / (3 * s.d + 1), 1 + ((s.d + 1) / k) ** 3) if job.input_side else (1, 1, 1)
    compensated = s.layers if job.compensated is None else job.compensated
    switch = 4 * (s.d * s.d + s.d * s.mlp) * compensated / s.layers  # a compensated switch's Where copies W_o, W_down
    # a trial's block: measured here (the one-block switchboard, batched and scored as select runs it); on the GPU, the block and the copies
    trial = r.trial * job.tokens / 256 if not device else block + switch / device["bandwidth"]
    sums = 2 * k * (3 * s.d + 1) * 8  # NormalEquations.nbytes
    runs = (1 + trials) * job.selection_windows
    where = runs * compensated * 4 * (s.d * s.d + s.d * s.mlp)  # the compensated switches' weight copies
    parts = {
        "fit forward": dict(flops=job.fit_windows * s.layers * s.block_flops(job.tokens, twin=True) * forward,
                            bytes=job.fit_windows * s.weight_bytes() * (2 if job.input_side else 1),
                            seconds=job.fit_windows * s.layers * block * twin * forward),
        "fit accumulate": dict(flops=job.fit_windows * s.layers * (n * k * k + 2 * n * k * s.d) * accumulate,
                               bytes=job.fit_windows * s.layers * 3 * (k * k + k * s.d) * 8 * accumulate,
                               seconds=job.fit_windows * s.layers * r.update * (n / 255) * accumulate),
        "fit solve": dict(flops=s.layers * (13 * k**3 + 6 * k * k * s.d) * solve, bytes=s.layers * 6 * k * k * 8 * solve,
                          seconds=s.layers * r.solve * solve),
        "selection": dict(flops=runs * (share * s.layers * s.block_flops(job.tokens) + s.head_flops(job.tokens)),
                          bytes=runs * share * s.weight_bytes() + where,
                          seconds=runs * (share * s.layers * trial + head)),  # the switches' Where copies are inside the measured trial
        "evaluation": dict(flops=2 * job.eval_windows * (s.layers * s.block_flops(job.tokens) + s.head_flops(job.tokens)),
                           bytes=2 * job.eval_windows * s.weight_bytes(), seconds=2 * job.eval_windows * (s.layers * block + head)),
        "write": dict(flops=0, bytes=s.weight_bytes(), seconds=s.weight_bytes() / r.write),
        # the fit's passes (together about the whole model), the switchboard, the two evaluated models, the profile
        "sessions": dict(flops=0, bytes=5 * s.weight_bytes(), seconds=5 * s.weight_bytes() * r.setup),
    }
    bound = job.fit_memory or _fit_memory()
    per_pass = max(1, bound // sums)
    inline = s.weight_bytes() < 2e9 if job.inline is None else job.inline
    weights, (loaded, session, fixed) = s.weight_bytes(), r.copies(inline)
    folded = compensated * 4 * (s.d * s.d + s.d * s.mlp)  # the switchboard's folded W_o, W_down
    fixes = s.layers * 2 * s.d * s.d * 8  # float64 w_a, w_p kept for every block
    reference = job.selection_windows * job.tokens * s.vocab * 4  # the original's log-probs, kept for the KL
    stages = {
        "fit": loaded * weights + session * weights + fixed + min(s.layers, per_pass) * sums + fixes,
        "selection": loaded * weights + folded + session * (weights + folded) + fixed + fixes + reference,
        "evaluation": loaded * weights + folded + 2 * (session * weights + fixed) + job.tokens * s.vocab * 4,  # both models' sessions
    }
    memory = max(stages.values())
    return {"parts": parts, "memory": memory, "fit_passes": -(-s.layers // per_pass) * (2 if job.input_side else 1)}


def diagnose(s: Shape, job: Job, r: Rates, device: dict | None = None) -> dict:
    block, head = _scaled(r, s, job, device)
    twin = s.block_flops(job.tokens, twin=True) / s.block_flops(job.tokens)
    flops = lambda blocks: blocks * s.block_flops(job.tokens) + s.head_flops(job.tokens)  # noqa: E731
    bandwidth = device["bandwidth"] if device else r.bandwidth
    losses_blocks, losses_runs = _loss_blocks(s.layers), 1 + 7 * s.layers + 10  # each run with the scored head
    rows = _prefix_runs(job.tokens)
    loss, prefix = (block, block) if device else (r.loss * job.tokens / 256, r.prefix * job.tokens / 256)
    zeros = 4 if job.zeros is None else job.zeros
    mlp_bytes = 3 * s.d * s.mlp * 4
    # the fixed-point steps stream the mlp's weights once per call (4 seeds: memory-bound); a zero's Jacobian: d mlp evaluations
    critical = s.layers * 200 * mlp_bytes / bandwidth * (1 if zeros == 0 else 0.5) + s.layers * zeros * s.d * 6 * s.d * s.mlp / (
        device["flops"] if device else s.block_flops(256) / r.block) + s.layers * mlp_bytes * r.setup  # each block's field session
    parts = {
        "probe": dict(flops=job.diag_windows * flops(s.layers * twin), bytes=job.diag_windows * s.weight_bytes(),
                      # measured on the one-block decoder (its twin mlp, in-graph statistics and effective ranks), plus the head
                      seconds=job.diag_windows * (s.layers * (r.probe if not device else block * twin) + head) + s.weight_bytes() * r.setup),
        "critical": dict(flops=s.layers * zeros * s.d * 6 * s.d * s.mlp, bytes=s.layers * 200 * mlp_bytes, seconds=critical),
        "prefix": dict(flops=job.diag_windows * rows * flops(s.layers), bytes=job.diag_windows * s.weight_bytes(),  # one batch a window
                       seconds=job.diag_windows * rows * (s.layers * prefix + head) + s.weight_bytes() * r.setup),
        "losses": dict(flops=job.diag_eval_windows * (losses_blocks * s.block_flops(job.tokens) + losses_runs * s.head_flops(job.tokens)),
                       bytes=job.diag_eval_windows * losses_blocks / s.layers * s.weight_bytes(),
                       seconds=job.diag_eval_windows * (losses_blocks * loss + losses_runs * head) + s.weight_bytes() * r.setup),
    }
    kept = s.layers * job.tokens * s.d * 4  # the unchanged run's resid_post per block, for the resumed runs
    loaded, session, fixed = r.copies(s.weight_bytes() < 2e9 if job.inline is None else job.inline)
    # the largest stage holds about two copies of the weights: on the 4-block model (1.23 GB) the probe peaked at 1.68 GB,
    # the prefix stage at 2.53 GB (its session beside the pages of the loaded model's external data the probe and
    # the critical points read: 0.88 GB before it), the loss runs at 2.16 GB
    return {"parts": parts, "memory": loaded * s.weight_bytes() + 2 * (session * s.weight_bytes() + fixed) + kept}


def _fit_memory() -> int:
    from surgery.compensation.memory import memory_bound

    return memory_bound("auto")


def _fmt_seconds(x: float) -> str:
    return f"{x:.0f} s" if x < 600 else f"{x / 60:.0f} min" if x < 36000 else f"{x / 3600:.0f} h"


def _measured(run: Path) -> dict:
    """Seconds of each part and the peak RSS of a run folder (module docstring)."""
    out: dict = {}
    log = Path(str(run) + ".time")
    if log.is_file():
        text = log.read_text()
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1).split(":")
        out["wall"] = sum(float(x) * 60**i for i, x in enumerate(reversed(wall)))
        out["rss"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) * 1024
    if (run / "selection.json").is_file():
        outcome = json.loads((run / "selection.json").read_text())
        sel = outcome["selection"]
        out["windows"] = {part: w["count"] for part, w in outcome["windows"].items()}
        split = sel.get("fit_seconds") or {}
        out.update({"fit forward": split.get("forward"), "fit accumulate": split.get("accumulate"), "fit solve": split.get("solve"),
                    "selection": sel["seconds"].get("selection"), "trials": len(sel["trials"]), "fit_memory": sel.get("fit_memory"),
                    "blocks_share": sel["blocks_run"] / (sel["forward_passes"] * len(sel["blocks"])) if sel.get("blocks_run") else None,
                    "input_side": any((b["fit"] or {}).get("input_residual") is not None for b in sel["blocks"])})
        out["kind"] = "parallelize"
        out["onnx_bytes"] = (run / "model.onnx").stat().st_size
    elif (run / "report.json").is_file():
        report = json.loads((run / "report.json").read_text())
        seconds = report["seconds"]
        out.update({"probe": seconds.get("probe"), "critical": seconds.get("critical"), "prefix": seconds.get("prefix"),
                    "losses": seconds.get("losses")})
        out["windows"] = {part: w["count"] for part, w in report["windows"].items()}
        out["zeros"] = np.mean([len(layer["points"]) for layer in report.get("critical", {}).get("layers", [])] or [4])
        out["kind"] = "diagnose"
        out["onnx_bytes"] = Path(report["model"]["path"]).stat().st_size
    return out


def validate(specs: list[str], rates: dict[str, Rates]) -> str:
    """Predicted against measured for each SHAPE:LAYERS:RUN; `rates` by shape name, or by spec (interleaved runs)."""
    rows = []
    for spec in specs:
        name, layers, run = spec.split(":", 2)
        shape, r = Shape(**SHAPES[name], layers=int(layers)), rates.get(spec) or rates[name]
        got = _measured(Path(run))
        w, inline = got["windows"], got["onnx_bytes"] > shape.weight_bytes() / 2  # the weights are in the .onnx file
        if got["kind"] == "parallelize":
            job = Job(fit_windows=w["fit"], selection_windows=w["selection"], eval_windows=w["evaluation"], trials=got["trials"],
                      fit_memory=got["fit_memory"], inline=inline, blocks_share=got["blocks_share"], input_side=got["input_side"])
            cost = parallelize(shape, job, r)
        else:
            job = Job(diag_windows=w["calibration"], diag_eval_windows=w["evaluation"], zeros=int(round(got["zeros"])), inline=inline)
            cost = diagnose(shape, job, r)
        label = f"{name} x{layers} {got['kind']}"
        for part, c in cost["parts"].items():
            if got.get(part) is not None:
                rows.append({"run": label, "part": part, "predicted": f"{c['seconds']:.1f} s", "measured": f"{got[part]:.1f} s",
                             "ratio": f"{c['seconds'] / got[part]:.2f}"})
        if "wall" in got:
            total = sum(c["seconds"] for c in cost["parts"].values())
            rows.append({"run": label, "part": "whole command (wall)", "predicted": f"{total:.1f} s", "measured": f"{got['wall']:.1f} s",
                         "ratio": f"{total / got['wall']:.2f}"})
        if "rss" in got:
            rows.append({"run": label, "part": "peak memory", "predicted": f"{cost['memory'] / 1e9:.2f} GB",
                         "measured": f"{got['rss'] / 1e9:.2f} GB", "ratio": f"{cost['memory'] / got['rss']:.2f}"})
    return table(rows, ["run", "part", "predicted", "measured", "ratio"])


COMMANDS = {"parallelize": ["parallelize", "{model}", "-o", "{out}", "--no-latency"], "diagnose": ["diagnose", "{model}", "-o", "{out}"]}
PER_BLOCK = ("trial", "probe", "loss", "prefix")  # the rates measured through the code's own runs of the one-block decoder
TIMED = ("block", "head", "update", "solve", "setup", *PER_BLOCK)  # the rates that are seconds (drift: after / before)


def interleaved(specs: list[str], runs: Path, scratch: Path) -> tuple[list[str], dict[str, Rates], list[dict]]:
    """Each KIND:SHAPE:LAYERS:MODEL run made under /usr/bin/time -v into `runs`, between two measurements of its
    shape's rates; returns the validate specs, the mean rates of each and the drift rows."""
    import subprocess

    runs.mkdir(parents=True, exist_ok=True)
    surgery = Path(sys.executable).with_name("surgery")
    out, rates, drift = [], {}, []
    for spec in specs:
        kind, name, layers, model = spec.split(":", 3)
        target = runs / f"{kind}-{name}-{layers}"
        shutil.rmtree(target, ignore_errors=True)
        shape = Shape(**SHAPES[name], layers=1)
        before = Rates.measure(shape, scratch)
        argv = [str(surgery)] + [a.format(model=model, out=target) for a in COMMANDS[kind]]
        with open(f"{target}.log", "w") as log:
            subprocess.run(["/usr/bin/time", "-v", "-o", f"{target}.time", *argv], check=True, stdout=log, stderr=subprocess.STDOUT)
        after = Rates.measure(shape, scratch)
        key = f"{name}:{layers}:{target}"
        rates[key] = dataclasses.replace(before, **{f: (getattr(before, f) + getattr(after, f)) / 2 for f in (*TIMED, "bandwidth", "write")})
        Path(f"{target}.rates.json").write_text(json.dumps({"before": dataclasses.asdict(before), "after": dataclasses.asdict(after)}))
        out.append(key)
        drift.append({"run": f"{name} x{layers} {kind}", **{f: f"{getattr(after, f) / getattr(before, f):.2f}" for f in TIMED}})
    return out, rates, drift


def project(rates: dict[str, Rates]) -> str:
    rows = []
    for name, layers in ((n, LAYERS[n]) for n in rates if n in LAYERS):
        shape = Shape(**SHAPES[name], layers=layers)
        for where, device in (("this CPU", None), (GPU["name"], GPU)):
            main, diag = parallelize(shape, Job(), rates[name], device), diagnose(shape, Job(), rates[name], device)
            seconds = {part: c["seconds"] for part, c in main["parts"].items()}
            fit = sum(v for k, v in seconds.items() if k.startswith("fit"))
            top = max(seconds, key=seconds.get)
            rows.append({
                "model": f"{name} x{layers} ({shape.weight_bytes() / 1e9:.1f} GB fp32)", "on": where,
                "fit (fwd / acc / solve)": f"{_fmt_seconds(fit)} ({' / '.join(_fmt_seconds(seconds[p]) for p in ('fit forward', 'fit accumulate', 'fit solve'))})",
                "selection": _fmt_seconds(seconds["selection"]), "main job": _fmt_seconds(sum(seconds.values())),
                "largest part": top, "diagnose": _fmt_seconds(sum(c["seconds"] for c in diag["parts"].values())),
                "memory": f"{main['memory'] / 1e9:.1f} GB", "fit passes": main["fit_passes"],
                "TFLOP": f"{sum(c['flops'] for c in main['parts'].values()) / 1e12:.0f}",
            })
    return table(rows, ["model", "on", "fit (fwd / acc / solve)", "selection", "main job", "largest part", "diagnose", "memory", "fit passes", "TFLOP"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", nargs="*", default=None, metavar="SHAPE:LAYERS:RUN")
    parser.add_argument("--run", nargs="*", default=None, metavar="KIND:SHAPE:LAYERS:MODEL", help="make these runs, interleaved with rates")
    parser.add_argument("--runs", type=Path, default=ROOT / "out" / "cost-runs", help="where --run writes its runs")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="the shapes to measure and project (comma-separated)")
    args = parser.parse_args()
    names = args.shapes.split(",")
    (ROOT / "out").mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=ROOT / "out", prefix="cost-"))
    try:
        if args.run:
            specs, per_run, drift = interleaved(args.run, args.runs, scratch)
            print("rates after each run / before it:\n\n" + table(drift, ["run", *TIMED]) + "\n")
            print(validate(specs, per_run) + "\n")
        rates = {name: Rates.measure(Shape(**SHAPES[name], layers=1), scratch) for name in names}
    finally:
        shutil.rmtree(scratch)
    rows = [{"shape": name, "block (256 tokens)": f"{r.block * 1e3:.0f} ms", "head": f"{r.head * 1e3:.0f} ms",
             "update (255 tokens)": f"{r.update * 1e3:.0f} ms", "solve": f"{r.solve:.1f} s", "session": f"{r.setup * 1e9:.2f} s/GB",
             **{f"{part} (a block, a window)": f"{getattr(r, part) * 1e3:.0f} ms" for part in PER_BLOCK},
             "weight copies: loaded / session (+ fixed)": "; ".join(f"{kind} {a:.2f} / {b:.2f} (+{f / 1e6:.0f} MB)"
                                                                for kind, c in (("external", r.external), ("inline", r.inline)) if c for a, b, f in [c])}
            for name, r in rates.items()]
    first = next(iter(rates.values()))
    print(f"measured here (memory {first.bandwidth / 1e9:.1f} GB/s, disk {first.write / 1e9:.2f} GB/s):\n")
    print(table(rows, ["shape", "block (256 tokens)", "head", "update (255 tokens)", "solve", "session", *(f"{p} (a block, a window)" for p in PER_BLOCK),
                       "weight copies: loaded / session (+ fixed)"]) + "\n")
    if args.validate:
        print(validate(args.validate, rates) + "\n")
    print(project({name: rates[name] for name in names if name in LAYERS}))


if __name__ == "__main__":
    main()
