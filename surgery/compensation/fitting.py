"""The compensation fit: a ridge least-squares fix of each block's sequential-to-parallel defect.

The input side first (where the mlp's input projections are found): with u = ln2(resid_pre) and
v = ln2(resid_mid) as the mlp's input projections read them, fit v - u ~ [u, 1] W_in, so the parallel block's mlp
reads u' = u (I + w_in) + b_in, a linear prediction of the input it had in the sequential block (folded into
W_gate and W_up: no extra op). Then the output side: A = attn_out, P = mlp(u') (mlp(u) without an input side) and
delta = mlp(ln2(resid_mid)) - P on calibration tokens. Fit delta ~ A w_a + P w_p + b, i.e. delta ~ z W with
z = [A, P, 1] (the least squares: surgery.compensation.equations).

The output side alone keeps the paper's mlp where the parallel block can evaluate it; the input side moves it most
of the way back to where the sequential block did (SmolLM2-135M: 15-66 % of |v - u|^2 left held out; RESULTS, "The
fix's input side"), and the output side fixes what is left.

The normal equations are accumulated in one streamed pass of the fit graph (surgery.analysis.fit_graph: the
switchboard with fit taps), so any set of already chosen blocks can be in place (switched on) while fitting others:
the sequential refit. Windows alternate between two folds; the ridge strength is the one whose fit on
fold 0 leaves the least defect energy on fold 1, and the final fit uses both folds. Per layer it
reports the held-out residual fraction E|delta - fit|^2 / E|delta|^2 (fold 1, fold-0 fit) and the
one-pass score C_l^comp = E|delta - fit|^2 / E|y|^2.

Memory: each layer's sums take 2 (2d + 1)(3d + 1) doubles: 32 MB at d_model 576, 1.6 GB at 4096 (the input side's,
2 (d + 1)(2d + 1), are freed before them). Layers are fitted in chunks within `FitSettings.memory` (at least one layer
each; two passes per chunk with an input side, else one). A pass runs only its own blocks, from the stream into its
first block that the pass before handed on ([tokens, d_model] float32 per window), so the passes together cost one
forward pass however many there are. On Ray (`pool`) each actor sums one contiguous run of the windows and the driver
adds the actors' sums in window order. Token 0 (the attention sink) is left out, as in every diagnostic.

Quantized projections (MatMulNBits): the fix is fitted on the int4 graph's own activations; the same pass sums x x' of
W_o's and W_down's inputs, and after the solve the codes of W_o (I + w_a) and W_down (I + w_p) are chosen on the node's
own scales error-aware with those moments (GPTQ, surgery.model.nbits; Fix.packed; `nearest` rounds instead). Quantized
W_gate / W_up get the codes of (I + w_in) W the same way on sum u u' (Fix.packed_in), and the output side's pass runs
the parallel mlp through those codes, so the output side fits what will run.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Mapping
from typing import Literal, get_args

import numpy as np
import onnx_ir as ir
from threadpoolctl import threadpool_limits

from surgery.analysis import switchboard as board_graph
from surgery.analysis.fit_graph import FIT_TAPS, INPUT_TAPS, MLP_IN_TAPS, RESUME, STREAM, Form, Stage, fit_graph, fit_tap, switched
from surgery.compensation import memory, requantization
from surgery.compensation.equations import RIDGES, FitResult, InputEquations, NormalEquations
from surgery.engine import cluster, runtime
from surgery.engine.progress import Count
from surgery.errors import SurgeryError
from surgery.files import checkpoint
from surgery.files.checkpoint import Checkpoints
from surgery.model.blocks import BlockMap
from surgery.model.embedding import embedding_table
from surgery.model.subject import Subject
from surgery.passes import Fix, fold
from surgery.passes.compensate import refusal
from surgery.text.data import Windows, spread

REQUANTIZE = ("gptq", "nearest")  # how a fix folded into MatMulNBits weights chooses their codes (surgery.model.nbits)
Kind = Literal["full", "gate"]  # least-squares fix, or the paper's scalar gate alpha_l (--calibrate)
KINDS: tuple[Kind, ...] = get_args(Kind)


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """How fixes are fitted: parallelize's Fit options, read once.

    Attributes:
        kind: `full` (ridge least squares: w_a, w_p, b, and an input side) or `gate` (alpha_l, the paper's scalar).
        windows: how many fit windows to read from the corpus's calibration part (`--fit-windows`).
        memory: the bytes one pass's normal equations may take (`--fit-memory`: bytes, `4G`, or None / `auto`; bytes once built).
        requantize: how a fold into MatMulNBits W_o / W_down chooses its codes (REQUANTIZE): `gptq`, on the moments of their
            inputs summed in the same pass, or `nearest`.
        input_fix: a full fix also gets an input side (Fix.w_in, b_in) where the mlp's input projections are found, fitted in
            a pass of its own first (`--input-fix`); a block compensated while fitted keeps its own.
        input_windows: the input side's pass runs on this many of the windows, evenly spaced (all when None).
        ridges: the ridge strengths to choose from, times diag(Z'Z); per layer, the one whose fold-0 fit leaves the least
            defect on fold 1.

    Raises:
        SurgeryError: an unknown kind or requantization, a memory bound that cannot be read, or input_windows below 1.
    """

    kind: Kind = "full"
    windows: int = 64
    memory: int | str | None = memory.MEMORY_BYTES
    requantize: str = "gptq"
    input_fix: bool = True
    input_windows: int | None = None
    ridges: tuple[float, ...] = RIDGES

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SurgeryError(f"unknown fit {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.requantize not in REQUANTIZE:
            raise SurgeryError(f"--requantize {self.requantize!r}: choose one of {', '.join(REQUANTIZE)}")
        if self.input_windows is not None and self.input_windows < 1:
            raise SurgeryError(f"input_windows {self.input_windows}: give a whole number of at least 1")
        object.__setattr__(self, "memory", memory.memory_bound(self.memory))  # bytes from here on

    @property
    def input_side(self) -> bool:
        """Whether the fixes get an input side: asked for, and a full fix."""
        return self.input_fix and self.kind == "full"


class Fits(dict):
    """What `fit` returns: layer -> FitResult, and where the fit's time went (`seconds`: forward, accumulate, solve)."""
    seconds: dict[str, float]
Sums = dict[int, NormalEquations | InputEquations]  # one pass's sums, by layer


class Accumulator:
    """One pass's fit graph in a session, and the normal equations of some of the windows: what this process holds,
    or each Ray actor (`cluster.Pool`), for one pass."""

    def __init__(self, graph: ir.Model, options: runtime.Options = runtime.Options()):
        self.session = runtime.session(graph, options)
        names = {arg.name for arg in self.session.get_inputs()} | {arg.name for arg in self.session.get_outputs()}
        self.resumes, self.hands_on = RESUME in names, STREAM in names
        self.names = names

    def run(
        self,
        chunk: list[int],
        ids: np.ndarray,
        first: int,
        switches: np.ndarray,
        streams: list[np.ndarray] | None = None,
        progress: Callable[[], None] | None = None,
        stage: Stage = "outputs",
        into: Sums | None = None,
    ) -> tuple[Sums, list[np.ndarray], dict[str, float]]:
        """The sums of `chunk`'s layers over the windows `ids` (row j is window first + j: fold (first + j) % 2),
        added to `into` when given; the stream the graph hands on, per window; the seconds of forward and accumulate.
        streams: per window, the stream into the pass's first block (when the graph resumes). stage `inputs`: the
        input side's sums (InputEquations) of the layers whose graph has its taps (fit_graph(stage="inputs"))."""
        sums = {} if into is None else into
        if stage == "inputs":
            return self._run_inputs(chunk, ids, first, switches, streams, progress, sums)
        clock, handed = {"forward": 0.0, "accumulate": 0.0}, []
        inputs = {l: [w for w in INPUT_TAPS if fit_tap(l, w) in self.names] for l in chunk}  # as the fit graph has them
        names = [fit_tap(l, w) for l in chunk for w in FIT_TAPS + tuple(inputs[l])]
        for j, out in self._windows(names, ids, first, switches, streams, clock, handed, progress, stage):
            for layer in chunk:  # token 0, the attention sink, left out
                attn_out, mlp_x, delta, resid_post = (out[fit_tap(layer, w)][0, 1:] for w in FIT_TAPS)
                if layer not in sums:  # not setdefault: that would allocate a layer's sums on every window
                    sums[layer] = NormalEquations(attn_out.shape[-1])
                sums[layer].update((first + j) % 2, attn_out, mlp_x, delta, resid_post)
                sums[layer].update_inputs({w: out[fit_tap(layer, w)][0, 1:] for w in inputs[layer]})
        return sums, handed, clock

    def _run_inputs(self, chunk, ids, first, switches, streams, progress, sums):
        layers = [l for l in chunk if fit_tap(l, MLP_IN_TAPS[0]) in self.names]
        clock, handed = {"forward": 0.0, "accumulate": 0.0}, []
        names = [fit_tap(l, w) for l in layers for w in MLP_IN_TAPS]
        for j, out in self._windows(names, ids, first, switches, streams, clock, handed, progress, "inputs"):
            for layer in layers:  # token 0, the attention sink, left out
                u, v = (out[fit_tap(layer, w)][0, 1:] for w in MLP_IN_TAPS)
                if layer not in sums:
                    sums[layer] = InputEquations(u.shape[-1])
                sums[layer].update((first + j) % 2, u, v)
        return sums, handed, clock

    def _windows(self, names, ids, first, switches, streams, clock, handed, progress, stage):
        """Run the graph on each window, yielding (row, outputs by name) of `names`: the stream it hands on appended
        to `handed`, the run's seconds to clock["forward"] and, until the next window, the caller's to clock["accumulate"]."""
        fetch = names + ([STREAM] if self.hands_on else [])
        for j in range(len(ids)):
            checkpoint.reached(f"fit {stage} window {first + j}")
            extra = {board_graph.SWITCHES: switches, **({RESUME: streams[j]} if self.resumes else {})}
            feed = runtime.feeds(self.session, ids[j : j + 1], extra=extra)
            start = time.perf_counter()
            out = dict(zip(fetch, self.session.run(fetch, feed)))
            clock["forward"] += time.perf_counter() - start
            if self.hands_on:
                handed.append(out[STREAM])
            start = time.perf_counter()
            yield j, out
            clock["accumulate"] += time.perf_counter() - start
            if progress:
                progress()



@dataclasses.dataclass(frozen=True)
class FitPlan:
    """What a fit does, worked out once before its first pass."""

    subject: Subject
    blocks: dict[int, BlockMap]  # by layer
    chunks: list[list[int]]  # the layers fitted together in each pass over the windows, in order
    sides: set[int]  # the layers whose fix gets an input side, in a pass of its own before their chunk's
    no_fold: dict[int, str | None]  # per sequential block: why its fix could not be folded into its weights, or None
    rows: np.ndarray  # the windows of the output side's passes (all)
    input_rows: np.ndarray  # ... and of the input side's
    fixes: dict[int, Fix]  # the fixes the fit graph holds
    compensated: set[int]  # the layers switched to compensated: they keep their fixes' input sides

    @property
    def runs(self) -> int:
        """How many windows all the passes together run: what progress counts to."""
        return len(self.chunks) * len(self.rows) + sum(1 for chunk in self.chunks if self.sides.intersection(chunk)) * len(self.input_rows)

    @property
    def model(self) -> ir.Model:
        return self.subject.model

    @property
    def values(self) -> dict[str, ir.Value]:
        return self.subject.values


def _plan(subject: Subject, windows: Windows, layers: Collection[int] | None, fixes: dict[int, Fix] | None,
          forms: Mapping[int, Form] | None, settings: FitSettings, pool: cluster.Pool) -> FitPlan | None:
    """fit's plan, or None when there is no sequential block to fit; SurgeryError for a block that cannot be fitted."""
    model, blocks = subject.model, subject.blocks
    table = embedding_table(model)
    if table is None:
        raise SurgeryError("cannot fit a compensation: found no token embedding table to read d_model from")
    no_fold = {b.layer: fold.unfoldable(model, b) for b in blocks if not b.is_parallel}
    for block in (b for b in blocks if layers is not None and b.layer in layers):
        if block.is_parallel or no_fold[block.layer]:
            raise SurgeryError(refusal(model, block) or (
                f"cannot compensate block {block.layer}: it is parallel already, so there is no sequential-to-parallel "
                "defect to fit; compensate the original sequential model"
            ))
    todo = [b.layer for b in blocks if not b.is_parallel and (layers is None or b.layer in layers)]
    if not todo:
        return None
    compensated = {layer for layer, form in (forms or {}).items() if form == "compensated"}
    return FitPlan(
        subject=subject,
        blocks={b.layer: b for b in blocks},
        chunks=_chunks(todo, table[1], settings.memory, pool.copies, requantization.input_widths(subject, todo, settings.requantize)),
        sides=_input_sided(subject, todo, skip=compensated) if settings.input_side else set(),
        no_fold=no_fold,
        rows=np.arange(len(windows)),
        input_rows=spread(len(windows), settings.input_windows),
        fixes=fixes or {},
        compensated=compensated,
    )


@dataclasses.dataclass
class _Runner:
    """Runs a fit's passes over the windows, in this process or on Ray actors, and tells how far it got
    (`progress`) and where the time went (`clock`)."""

    windows: Windows
    switches: np.ndarray
    pool: cluster.Pool
    options: runtime.Options
    clock: dict[str, float]
    progress: Count | None
    total: int
    work: Checkpoints
    done: int = 0

    def tick(self, count: int = 1) -> None:
        self.done += count
        if self.progress:
            self.progress(self.done, self.total)

    def run(self, graph: ir.Model, chunk: list[int], streams: list[np.ndarray] | None, stage: Stage, rows: np.ndarray, unit: str
            ) -> tuple[Sums, list[np.ndarray]]:
        """One pass of `graph` over the windows `rows` (indices, in order): the chunk's sums, added in window order,
        and the streams handed on. Row j of `rows` is in fold j % 2. In this process, the pass resumes from and keeps
        snapshots of its sums as `unit` (when `work.due()`); on Ray, an actor that dies is restarted and its run redone."""

        def job(first: int, r: np.ndarray, progress) -> tuple:  # Accumulator.run's arguments for the rows r
            return chunk, self.windows.ids[r], first, self.switches, None if streams is None else [streams[i] for i in r], progress, stage

        if not self.pool.distributed:
            return self._local(Accumulator(graph, self.options), job, rows, unit)
        runs = [(int(p[0]), rows[p]) for p in np.array_split(np.arange(len(rows)), self.pool.workers) if len(p)]  # one contiguous run per actor
        actors = self.pool.actors(graph, functools.partial(Accumulator, options=self.pool.options(self.options)))
        return self._gather(runs, actors.map("run", [job(a, r, None) for a, r in runs], unit=f"fit {stage} windows"))

    def _local(self, accumulator: Accumulator, job, rows: np.ndarray, unit: str) -> tuple[Sums, list[np.ndarray]]:
        """The pass in this process, window by window into the same sums (so a resumed pass adds the same numbers in
        the same order), from the snapshot of `unit` when there is one."""
        snapshot = self.work.load(unit) or {"done": 0, "sums": {}, "handed": []}
        sums, handed, done = snapshot["sums"], snapshot["handed"], snapshot["done"]
        if done:
            self.tick(done)
        for j in range(done, len(rows)):
            _, stream, clock = accumulator.run(*job(j, rows[j : j + 1], self.tick), into=sums)
            handed.extend(stream)
            for key, value in clock.items():
                self.clock[key] += value
            if j + 1 < len(rows) and self.work.due(sum(eq.nbytes_held for eq in sums.values())):
                self.work.save(unit, {"done": j + 1, "sums": sums, "handed": handed})
        return sums, handed

    def _gather(self, runs: list[tuple[int, np.ndarray]], parts: list[tuple]) -> tuple[Sums, list[np.ndarray]]:
        """The Ray actors' sums added, and their streams, in window order."""
        sums: Sums = {}
        handed: list[np.ndarray] = []
        for (_, r), (part, stream, part_clock) in zip(runs, parts):
            start = time.perf_counter()
            for layer, eq in part.items():
                if layer in sums:
                    sums[layer].add(eq)
                else:  # what a Ray actor returned is read-only
                    sums[layer] = eq if eq.zz.flags.writeable else copy.deepcopy(eq)
            handed.extend(stream)
            self.clock["accumulate"] += time.perf_counter() - start
            for key, value in part_clock.items():
                self.clock[key] += value
            if self.pool.distributed:
                self.tick(len(r))
        return sums, handed


def fit(
    model: "ir.Model | Subject",
    windows: Windows,
    layers: Collection[int] | None = None,
    *,
    settings: FitSettings = FitSettings(),
    fixes: dict[int, Fix] | None = None,
    forms: Mapping[int, Form] | None = None,
    options: runtime.Options = runtime.Options(),
    pool: cluster.Pool | None = None,
    progress: Count | None = None,
    work: Checkpoints | None = None,
) -> Fits:
    """Fit the fix of each sequential block in `layers` on `windows`: kind `full` (least squares) or `gate` (alpha_l).

    The layers are fitted in passes over the windows, as many at a time as `settings.memory` holds, about one forward pass in all (module docstring).

    Args:
        model: the model (or its Subject); not modified.
        windows: the fit windows (`windows(..., part="calibration")`); they alternate between the two folds that choose each layer's ridge.
        layers: the blocks to fit, by index from 0 (all sequential blocks when None). A parallel block, or one that normalises its branch outputs, asked
            for is refused; when None, the latter gets no fix.
        fixes: the fixes the graph holds while fitting (the sequential refit), by layer.
        forms: the blocks switched to parallel while fitting and their form, e.g. {3: "compensated", 7: "plain"}.
        settings: how to fit (FitSettings: kind, memory bound, requantization, input side, ridges); its `windows` count is the caller's.
        options: ONNX Runtime session options.
        pool: Ray actors (cluster.pool(workers=...)) each accumulate the sums of one contiguous run of the windows, and this process adds them in window
            order; None or an in-process pool: one session here, window by window.
        progress: called as progress(windows done, windows total), counting the windows of every pass.
        work: where the fit keeps its finished units (each chunk's results, its input sides, snapshots of a pass's sums) and resumes from them
            (surgery.files.checkpoint; None: nothing kept). A resumed fit gives the same fixes, bit for bit, as one that ran through.

    Returns:
        Fits: layer -> FitResult of each fitted block ({} when none): the fix (None when the fit failed or cannot be folded; note says why),
        the held-out residual fraction and C_l^comp, the tokens, the uncompensated scores (c, c_stream, alpha); `seconds`: forward (the graph's
        runs), accumulate (the float64 sums; on Ray, summed over the actors) and solve (the ridge choice, the solve, any requantization).

    Raises:
        SurgeryError: no token embedding table, or a block in `layers` that cannot be fitted.
    """
    options = dataclasses.replace(options, spinning=False)  # the sums are NumPy work between the runs, on the same cores
    results = Fits()
    results.seconds = clock = {"forward": 0.0, "accumulate": 0.0, "solve": 0.0}
    pool, work = pool or cluster.Pool(), work or Checkpoints.off()
    plan = _plan(Subject.of(model), windows, layers, fixes, forms, settings, pool)
    if plan is None:
        return results
    if (kept := work.load("chunks")) is not None:  # the chunks the interrupted run fitted (the memory bound may read otherwise now)
        plan = dataclasses.replace(plan, chunks=kept)
    work.save("chunks", plan.chunks)
    runner = _Runner(windows, switched(len(plan.blocks), forms), pool, options, clock, progress, plan.runs, work)
    streams: list[np.ndarray] | None = None  # per window: the stream into this pass's first block
    # One BLAS thread for the float64 sums and solves, on every machine and as on each Ray actor: OpenBLAS splits its
    # products by its thread count, which moves their last bits (SmolLM2's fixes differ by 4e-15 between 1 and 2 BLAS
    # threads), and with them the written weights. ORT's thread count changes nothing.
    with threadpool_limits(1, user_api="blas"):
        for c in range(len(plan.chunks)):
            solved, streams = _fit_chunk(plan, runner, c, streams, settings)
            results.update(solved)
    return results


def _fit_chunk(plan: FitPlan, runner: _Runner, c: int, streams: list[np.ndarray] | None, settings: FitSettings
               ) -> tuple[dict[int, FitResult], list[np.ndarray]]:
    """Chunk c's fits and the streams it hands on to the next chunk: its input side's pass and output side's pass from
    `streams` (the stream into its first block, per window; None for the first chunk), and the solve. A checkpoint unit:
    read back when the work folder has it."""
    chunk, work = plan.chunks[c], runner.work
    if (done := work.load(f"chunk-{c}")) is not None:
        runner.tick(len(plan.rows) + (len(plan.input_rows) if plan.sides.intersection(chunk) else 0))
        return done["results"], done["streams"]
    resume, hand_on = chunk[0] if c else None, plan.chunks[c + 1][0] if c + 1 < len(plan.chunks) else None
    input_sides = _fit_input_sides(plan, runner, c, resume, streams, settings)
    graph = fit_graph(plan.subject, plan.fixes, chunk, resume=resume, hand_on=hand_on, inputs=settings.requantize == "gptq",
                      input_sides={l: side for l, (side, _) in input_sides.items()})
    sums, streams = runner.run(graph, chunk, streams, "outputs", plan.rows, f"chunk-{c}-outputs")
    del graph
    start = time.perf_counter()
    solved = _solve(plan, chunk, sums, settings, input_sides)
    runner.clock["solve"] += time.perf_counter() - start
    del sums
    work.save(f"chunk-{c}", {"results": solved, "streams": streams})
    work.drop(f"chunk-{c}-outputs")
    return solved, streams


def _fit_input_sides(plan: FitPlan, runner: _Runner, c: int, resume: int | None,
                     streams: list[np.ndarray] | None, settings: FitSettings) -> dict[int, tuple[Fix, float]]:
    """The input side's pass over chunk c's layers that get one, from the same stream as the output side's (which
    hands it on), and its solve: per layer, the input side and its held-out residual fraction (a checkpoint unit).
    Where the mlp's input projections are MatMulNBits, `gptq` chooses the codes of (I + w_in) W error-aware on the
    second moment of what they read, u, which the pass summed (Fix.packed_in)."""
    chunk = plan.chunks[c]
    sided = [l for l in chunk if l in plan.sides]
    if not sided:
        return {}
    if (done := runner.work.load(f"chunk-{c}-input-sides")) is not None:
        runner.tick(len(plan.input_rows))
        return done
    graph = fit_graph(plan.subject, plan.fixes, sided, resume=resume, stage="inputs")
    sums, _ = runner.run(graph, chunk, streams, "inputs", plan.input_rows, f"chunk-{c}-inputs")
    start = time.perf_counter()
    solved = {layer: sums[layer].solve(settings.ridges) for layer in sided}
    runner.clock["solve"] += time.perf_counter() - start
    sides = {layer: side for layer, side in solved.items() if side is not None}
    if settings.requantize == "gptq":
        sides = {layer: (requantization.input_codes(plan.model, plan.values, plan.blocks[layer], fix, sums[layer]), residual)
                 for layer, (fix, residual) in sides.items()}
    runner.work.save(f"chunk-{c}-input-sides", sides)
    runner.work.drop(f"chunk-{c}-inputs")
    return sides


def _solve(plan: FitPlan, chunk: list[int], sums: dict[int, NormalEquations], settings: FitSettings,
           input_sides: dict[int, tuple[Fix, float]]) -> dict[int, FitResult]:
    """The chunk's fixes from its output side's sums, each with its input side, requantized where W_o and W_down
    are MatMulNBits (their inputs' second moments were gathered)."""
    results = {}
    for layer in chunk:
        result = sums[layer].solve(layer, settings.kind, settings.ridges)
        if plan.no_fold[layer]:  # scored, but its fix has nowhere to go: the block stays plain
            result = dataclasses.replace(result, fix=None, note=plan.no_fold[layer])
        elif result.fix is not None:
            # a block compensated while fitted (the refit) keeps its fix's input side, which its mlp read
            kept = plan.fixes.get(layer) if layer in plan.compensated else None
            side, residual = input_sides.get(layer, (kept, None))
            if side is not None and side.fixes_input:
                fix = dataclasses.replace(result.fix, w_in=side.w_in, b_in=side.b_in, packed_in=side.packed_in)
                result = dataclasses.replace(result, fix=fix, input_residual=residual)
            if sums[layer].grams:
                fix = requantization.output_codes(plan.model, plan.values, plan.blocks[layer], result.fix, sums[layer].grams)
                result = dataclasses.replace(result, fix=fix)
        results[layer] = result
    return results


def _chunks(layers: list[int], d_model: int, memory_bytes: int, copies: int = 1, widths: dict[int, tuple[int, ...]] | None = None
            ) -> list[list[int]]:
    """The layers fitted together in each pass over the windows, in order: as many as fit in memory_bytes, which
    `copies` of the sums share (the driver's and, on a local Ray cluster, each actor's), at least one. widths: per
    layer, the input widths of its quantized output projections (their second moments are summed too)."""
    chunks: list[list[int]] = []
    used = 0
    for layer in layers:
        size = copies * NormalEquations.nbytes(d_model, (widths or {}).get(layer, ()))
        if chunks and used + size <= memory_bytes:
            chunks[-1].append(layer)
            used += size
        else:
            chunks.append([layer])
            used = size
    return chunks


def fit_passes(model: "ir.Model | Subject", layers: Collection[int] | None = None, settings: FitSettings = FitSettings(),
               pool: cluster.Pool | None = None, compensated: Collection[int] = ()) -> int:
    """How many passes over the fit windows `fit` makes for these layers (all sequential blocks when None): one per chunk
    of layers, and one more for each chunk with an input side to fit (none for the `compensated` ones: they keep theirs)."""
    subject = Subject.of(model)
    table = embedding_table(subject.model)
    todo = [b.layer for b in subject.blocks if not b.is_parallel and (layers is None or b.layer in layers)]
    if not todo or not table:
        return 0
    chunks = _chunks(todo, table[1], settings.memory, (pool or cluster.Pool()).copies, requantization.input_widths(subject, todo, settings.requantize))
    sides = _input_sided(subject, todo, skip=compensated) if settings.input_side else set()
    return len(chunks) + sum(1 for chunk in chunks if sides.intersection(chunk))


def _input_sided(subject: Subject, layers: Collection[int], skip: Collection[int] = ()) -> set[int]:
    """The layers whose fix gets an input side: its mlp's input projections are found (float or MatMulNBits), the fix
    folds, and the layer is not in `skip` (compensated already: it keeps its fix's)."""
    return {l for l in layers if l not in skip and fold.unfoldable(subject.model, subject.blocks[l], subject.values, "inputs") is None}
