"""The compensation fit: a ridge least-squares fix of each block's sequential-to-parallel defect.

The input side first (where the mlp's input projections are plain float ones): with u = ln2(resid_pre) and
v = ln2(resid_mid) as the mlp's input projections read them, fit v - u ~ [u, 1] W_in, so the parallel block's mlp
reads u' = u (I + w_in) + b_in, a linear prediction of the input it had in the sequential block (folded into
W_gate and W_up: no extra op). Then the output side: A = attn_out, P = mlp(u') (mlp(u) without an input side) and
delta = mlp(ln2(resid_mid)) - P on calibration tokens. Fit delta ~ A w_a + P w_p + b, i.e. delta ~ z W with
z = [A, P, 1]:

    W = (Z'Z + ridge * diag(Z'Z))^-1 Z'delta        (float64)

The output side alone keeps the paper's mlp, evaluated where the parallel block can evaluate it; the input side
moves it most of the way back to where the sequential block evaluated it (on SmolLM2-135M's blocks 5-7 and 21-29
the linear prediction leaves 15-66 % of |v - u|^2 held out: benchmarks/input_side.py), and the output side fixes
what is left.

The normal equations are accumulated in one streamed pass of the switchboard graph with fit taps,
so any set of already chosen blocks can be in place (switched on) while fitting others: the
sequential refit. Windows alternate between two folds; the ridge strength is the one whose fit on
fold 0 leaves the least defect energy on fold 1, and the final fit uses both folds. Per layer it
reports the held-out residual fraction E|delta - fit|^2 / E|delta|^2 (fold 1, fold-0 fit) and the
one-pass score C_l^comp = E|delta - fit|^2 / E|y|^2.

Memory: each layer's sums take 2 (2d + 1)(3d + 1) doubles: 32 MB at d_model 576, 1.6 GB at 4096 (the input
side's, 2 (d + 1)(2d + 1), are freed before them). Layers are fitted in chunks that stay within `memory_bytes` (two
passes over the windows per chunk, the input side's and the output side's, or one without an input side; at least
one layer per chunk), so the bound is max(memory_bytes, one layer's sums). A pass runs only
its own blocks: it starts from the stream into its first block that the pass before handed on (one
[tokens, d_model] float32 array per window) and stops after its last block, so the passes together cost
one forward pass over the windows however many there are. On Ray (`pool`) each actor sums one contiguous
run of the windows and the driver adds the actors' sums in window order.
Token 0 (the attention sink) is left out, as in every diagnostic.

Quantized output projections (MatMulNBits W_o and W_down): the fix is fitted on the int4 graph's own activations,
and the same pass sums x x' of each projection's input (the parallel block's, for W_down: K_o^2 + K_down^2 more
doubles per layer); after the solve the codes of W_o (I + w_a) and W_down (I + w_p) are chosen on the node's own
scales error-aware with those moments (GPTQ, surgery.nbits), kept in Fix.packed; `requantize="nearest"` gathers
nothing and leaves them to the fold, which rounds to nearest.

Drift-correcting fit (`drift`): with chosen blocks already rewritten (switched on), a block's fix is instead fitted
to the original model's resid_post y of that block, kept from the first pass: target = y - (x' + A' + P') with
x', A', P' from the rewritten model's stream, so the fix also undoes the drift that reaches the block from the
rewritten blocks before it (cf. ReplaceMe, NeurIPS 2025: closed-form least-squares fits to the original model's
activations). On the unmodified stream the target is delta itself.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import time
from collections.abc import Callable, Collection

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery import cluster, defect, runtime
from surgery.analysis import switchboard as board_graph
from surgery.analysis.probe import twin_branch
from surgery.blocks import BlockMap, branch_nodes, find_blocks
from surgery.data import Windows, spread
from surgery.errors import SurgeryError
from surgery.facts import embedding_table, stream_dtype
from surgery.nodes import Emitter, values_by_name
from surgery.passes import Fix, projection
from surgery.passes.compensate import input_fixed, redirect_readers, refusal

RIDGES = (1e-8, 1e-6, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 0.3, 1.0, 3.0)  # times diag(Z'Z); chosen per layer on the held-out fold
MEMORY_BYTES = 2 << 30  # the normal equations' bound when the available memory cannot be read (--fit-memory auto: a quarter of it)
MEMORY_SHARE = 0.25
KINDS = [("parallelize",), ("compensate",)]  # the switchboard kinds every fit and trial uses
FIT_TAPS = ("attn_out", "mlp_x", "delta", "resid_post")  # what the fit graph outputs per sequential block
INPUT_TAPS = ("o_in", "down_in")  # ... and, where W_o and W_down are MatMulNBits, their inputs (the parallel block's)
MLP_IN_TAPS = ("mlp_u", "mlp_v")  # ... and in the input side's pass: ln2(resid_pre) and ln2(resid_mid) as the mlp reads them
STAGES = ("inputs", "outputs")  # a fit graph's taps: the input side's (MLP_IN_TAPS) or the output side's (the rest)
REQUANTIZE = ("gptq", "nearest")  # how a fix folded into MatMulNBits weights chooses their codes (surgery.nbits)
RESUME, STREAM = "surgery/fit/resid_pre", "surgery/fit/stream"  # a pass's stream into its first block, from the pass before
Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class FitResult:
    """One block's fitted fix and how well it generalises. fix is None when the fit failed (note says why)."""

    layer: int
    fix: Fix | None
    ridge: float | None
    residual: float | None  # held-out E|delta - fit|^2 / E|delta|^2 (delta: the input-fixed block's defect, with an input side)
    c_comp: float | None  # held-out E|delta - fit|^2 / E|y|^2
    tokens: int
    note: str = ""
    scores: dict = dataclasses.field(default_factory=dict)  # c, c_stream, alpha on the fit windows
    input_residual: float | None = None  # the input side: held-out E|v - u'|^2 / E|v - u|^2 (None: no input side)

    @property
    def c_stream(self) -> float:
        """E|delta|^2 / E|y|^2 on the fit windows: the uncompensated score."""
        return self.scores["c_stream"]

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fix"}


class _Sums:
    """One block's running sums of a ridge least squares target ~ z W (z's last column 1), per fold, in float64."""

    def __init__(self, k: int, d_model: int):
        self.zz = np.zeros((2, k, k))
        self.zd = np.zeros((2, k, d_model))
        self.dd = np.zeros(2)  # sum |target|^2
        self.tokens = np.zeros(2, dtype=np.int64)

    def _accumulate(self, fold: int, z: np.ndarray, target: np.ndarray, weight: np.ndarray | None) -> np.ndarray | float:
        """Add z'z, z'target and |target|^2 to the fold's sums, products in z's precision; weight [tokens]: each token's
        terms weighed by it (rows scaled by its root). Returns the weights as a column, or 1.0."""
        w = 1.0
        energy = target.astype(np.float64) ** 2
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite activations are refused in solve()
            if weight is not None:
                w = weight.astype(np.float64)[:, None]
                root = np.sqrt(w).astype(z.dtype)
                z, target = z * root, target * root
            self.zz[fold] += z.T @ z
            self.zd[fold] += z.T @ target
        self.dd[fold] += float(np.sum(w * energy))
        self.tokens[fold] += len(z)
        return w

    def add(self, other: "_Sums") -> None:
        """Add another's sums (of other windows) to these."""
        for mine, theirs in ((self.zz, other.zz), (self.zd, other.zd), (self.dd, other.dd), (self.tokens, other.tokens)):
            mine += theirs

    def _finite(self) -> bool:
        return all(np.isfinite(a).all() for a in (self.zz, self.zd, self.dd))

    def _fit(self, ridges) -> tuple[float, float, np.ndarray]:
        """The ridge whose fold-0 fit leaves the least target energy on fold 1, that energy, and the fit on both folds
        with it; LinAlgError when no ridge gives a finite fit."""
        ridge, left = _choose_ridge(self.zz[0], self.zd[0], self.zz[1], self.zd[1], self.dd[1], ridges)
        return ridge, left, _ridge_solve(self.zz.sum(0), self.zd.sum(0), ridge)


class NormalEquations(_Sums):
    """One block's running sums for delta ~ [A, P, 1] W, per fold, in float64."""

    def __init__(self, d_model: int):
        super().__init__(2 * d_model + 1, d_model)
        self.yy = np.zeros(2)  # sum |resid_post|^2
        self.grams: dict[str, np.ndarray] = {}  # INPUT_TAPS -> sum x x' over both folds (quantized W_o, W_down)

    @staticmethod
    def nbytes(d_model: int, inputs: Collection[int] = ()) -> int:
        """The sums' bytes; inputs: the widths of the projection inputs whose second moments are kept too."""
        return 2 * (2 * d_model + 1) * (3 * d_model + 1) * 8 + sum(8 * k * k for k in inputs)

    def update_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        """Add tokens of the quantized output projections' inputs ([tokens, K] each) to their second moments."""
        for name, x in inputs.items():
            x = x.astype(np.result_type(x, np.float32))
            gram = x.T @ x
            if name in self.grams:
                self.grams[name] += gram
            else:
                self.grams[name] = gram.astype(np.float64)

    def update(
        self, fold: int, attn_out: np.ndarray, mlp_x: np.ndarray, delta: np.ndarray, resid_post: np.ndarray, weight: np.ndarray | None = None
    ) -> None:
        """Add tokens: each argument [tokens, d_model]; delta is the fit's target (the defect, or what the
        drift-correcting fit aims at). One window's products are formed in the activations' own precision
        (at least float32, what ORT computed them in) and added to the float64 sums, so the sums carry no
        error the activations do not already have. weight: [tokens], a weighted least squares (every sum,
        |delta|^2 and |resid_post|^2 too, weighs each token's terms by it); None: 1."""
        dtype = np.result_type(attn_out, mlp_x, delta, np.float32)
        z = np.concatenate([attn_out, mlp_x, np.ones((len(delta), 1))], axis=1, dtype=dtype)
        w = self._accumulate(fold, z, delta.astype(dtype), weight)
        self.yy[fold] += float(np.sum(w * resid_post.astype(np.float64) ** 2))

    def add(self, other: "NormalEquations") -> None:
        super().add(other)
        self.yy += other.yy
        for name, gram in other.grams.items():
            self.grams[name] = self.grams[name] + gram if name in self.grams else gram.copy()

    def _traces(self, fold) -> tuple[float, float, float]:
        """sum |P|^2, sum <P, delta>, sum |delta|^2 over fold 0, 1, or both (None)."""
        d = self.zd.shape[2]
        zz, zd, dd = (a.sum(0) if fold is None else a[fold] for a in (self.zz, self.zd, self.dd))
        p = slice(d, 2 * d)
        return float(np.trace(zz[p, p])), float(np.trace(zd[p])), float(dd)

    def scores(self) -> dict[str, float]:
        """The uncompensated one-pass scores over all fit tokens: C_l, C_l^stream and the gate alpha_l."""
        pp, pd, dd = self._traces(None)  # mlp(ln2 h) = P + delta: |.|^2 = pp + 2 pd + dd, <., P> = pp + pd
        return defect.ratios(dd, pp + 2 * pd + dd, float(self.yy.sum()), pp + pd, pp)

    def solve(self, layer: int, kind: str = "full", ridges=RIDGES, defect: bool = True) -> FitResult:
        """The fix of one block: `full` (ridge least squares, the ridge chosen on the held-out fold,
        then refitted on both folds) or `gate` (alpha_l, the paper's scalar). A fit that is not
        finite is refused (fix None, with a note). defect: the target was the defect itself, so the
        one-pass scores (C_l, C_l^stream, alpha_l) can be read off the sums; False leaves them out."""
        d = self.zd.shape[2]
        tokens, scores = int(self.tokens.sum()), self.scores() if defect else {}
        failed = lambda why: FitResult(layer, None, None, None, None, tokens, why, scores)  # noqa: E731
        if self.tokens.min() == 0:
            return failed("too few windows to hold one fold out; give more fit windows")
        if not (self._finite() and np.isfinite(self.yy).all()):
            return failed("non-finite activations in the fit windows; the block stays plain parallel")
        if kind == "gate":
            (pp0, pd0, _), (pp1, pd1, dd1) = self._traces(0), self._traces(1)
            g0 = pd0 / max(pp0, 1e-300)  # alpha - 1, fitted on fold 0
            left = dd1 - 2 * g0 * pd1 + g0 * g0 * pp1
            fix, ridge = Fix.gate(scores["alpha"]), None
        else:
            try:
                ridge, left, weights = self._fit(ridges)
            except np.linalg.LinAlgError as e:
                return failed(f"ill-conditioned ({e}); the block stays plain parallel")
            if not np.isfinite(weights).all():
                return failed("ill-conditioned: the fit is not finite; the block stays plain parallel")
            fix = Fix(w_a=weights[:d], w_p=weights[d : 2 * d], b=weights[2 * d])
        left = max(float(left), 0.0)
        return FitResult(layer, fix, ridge, left / max(float(self.dd[1]), 1e-300), left / max(float(self.yy[1]), 1e-300), tokens, "", scores)


class InputEquations(_Sums):
    """One block's running sums for the input side, v - u ~ [u, 1] W with u = ln2(resid_pre) and v = ln2(resid_mid) as
    the mlp's input projections read them, per fold, in float64: Fix.w_in and b_in, so that the parallel block's mlp
    reads a linear prediction of its sequential input."""

    def __init__(self, d_model: int):
        super().__init__(d_model + 1, d_model)

    def update(self, fold: int, u: np.ndarray, v: np.ndarray, weight: np.ndarray | None = None) -> None:
        """Add tokens ([tokens, d_model] each), products in the activations' precision (at least float32); weight:
        [tokens], a weighted least squares as in NormalEquations.update."""
        dtype = np.result_type(u, v, np.float32)
        z = np.concatenate([u, np.ones((len(u), 1))], axis=1, dtype=dtype)
        self._accumulate(fold, z, v.astype(dtype) - u.astype(dtype), weight)

    def solve(self, ridges=RIDGES) -> tuple[Fix, float] | None:
        """The input side (a Fix with w_in and b_in only) and its held-out residual fraction, the ridge chosen as
        NormalEquations.solve chooses it; None when it cannot be fitted (too few windows, not finite)."""
        d = self.zd.shape[2]
        if self.tokens.min() == 0 or not self._finite():
            return None
        try:
            _, left, weights = self._fit(ridges)
        except np.linalg.LinAlgError:
            return None
        if not np.isfinite(weights).all():
            return None
        return Fix(w_in=weights[:d], b_in=weights[d]), max(float(left), 0.0) / max(float(self.dd[1]), 1e-300)


def _scaling(zz: np.ndarray) -> np.ndarray:
    """Jacobi scaling diag(zz)^-1/2: the scaled Gram matrix has a unit diagonal, so the ridge is
    relative to each feature's energy."""
    diag = np.diag(zz)
    return 1.0 / np.sqrt(np.maximum(diag, 1e-12 * max(float(diag.max()), 1e-300)))


def _choose_ridge(zz0, zd0, zz1, zd1, dd1, ridges) -> tuple[float, float]:
    """The ridge whose fit on fold 0 leaves the least defect energy on fold 1, and that energy.

    With s the scaling, s zz0 s = Q diag(lam) Q' and B = Q' s zd0, the fold-0 fit is
    W = s Q diag(f) B, f = 1 / (lam + ridge); its fold-1 residual |delta|^2 - 2 tr(W' zd1) + tr(W' zz1 W)
    is dd1 - 2 f.(rowsum(B * E)) + f' (M * B B') f with E = Q' s zd1, M = Q' s zz1 s Q: O(k^2) per ridge.
    """
    s = _scaling(zz0)
    lam, q = np.linalg.eigh(s[:, None] * zz0 * s[None, :])
    lam = np.maximum(lam, 0.0)
    b = q.T @ (s[:, None] * zd0)
    e = q.T @ (s[:, None] * zd1)
    m = q.T @ (s[:, None] * zz1 * s[None, :]) @ q
    cross, mc = np.sum(b * e, axis=1), m * (b @ b.T)
    best = None
    for r in ridges:
        f = 1.0 / (lam + r)
        left = float(dd1 - 2 * (f @ cross) + f @ mc @ f)
        if np.isfinite(left) and (best is None or left < best[1]):
            best = (r, left)
    if best is None:
        raise np.linalg.LinAlgError("no ridge strength gave a finite fit")
    return best


def _ridge_solve(zz: np.ndarray, zd: np.ndarray, ridge: float) -> np.ndarray:
    """W = (zz + ridge diag(zz))^-1 zd, solved in the Jacobi-scaled basis."""
    s = _scaling(zz)
    scaled = s[:, None] * zz * s[None, :]
    scaled[np.diag_indices_from(scaled)] += ridge
    return s[:, None] * np.linalg.solve(scaled, s[:, None] * zd)


def fit_tap(layer: int, what: str) -> str:
    """Output name of a fit tap: `what` is one of FIT_TAPS (mlp_x is P)."""
    return f"surgery/fit/blocks.{layer}/{what}"


def fit_graph(model: ir.Model, fixes: dict[int, Fix] | None = None, layers: Collection[int] | None = None,
              resume: int | None = None, hand_on: int | None = None, inputs: bool = True, stage: str = "outputs",
              input_sides: dict[int, Fix] | None = None) -> ir.Model:
    """The switchboard of KINDS reduced to the fit taps of the sequential blocks in `layers` (all when None; no logits,
    no KV cache): attn_out, P = mlp(ln2(resid_pre)), delta = mlp(ln2(resid_mid)) - P and resid_post, whatever the
    switches (each block's mlp is evaluated a second time, on the input its branch does not read).

    resume: block `resume` reads its resid_pre from the input RESUME (as an earlier pass handed it on), so the blocks
    before it compute nothing; hand_on: output block `hand_on`'s resid_pre as STREAM. Nothing after the last block
    whose taps or stream are asked for is computed: ORT runs a whole graph whatever outputs a run asks for.
    inputs: also the inputs of W_o and W_down where both are MatMulNBits (INPUT_TAPS), for the error-aware requantization.
    stage: `outputs`, the taps above; `inputs`, the input side's MLP_IN_TAPS instead (ln2(resid_pre) and ln2(resid_mid)
    as the mlp's input projections read them, where they are plain projections), and none of the twin mlp is computed.
    input_sides: per layer, the input side (Fix.w_in, b_in) the parallel block's mlp reads through while the layer's
    parallelize switch is off, so mlp_x and delta are those of the input-fixed parallel block."""
    if stage not in STAGES:
        raise ValueError(f"unknown fit stage {stage!r}")
    board = board_graph.switchboard(model, KINDS, fixes, taps=functools.partial(_fit_taps, input_sides=input_sides or {}))
    g = board.graph
    names = MLP_IN_TAPS if stage == "inputs" else FIT_TAPS + (INPUT_TAPS if inputs else ())
    taps = [v for v in g.outputs if v.name.startswith("surgery/fit/") and v.name.endswith(names)
            and (layers is None or v.name.split("/")[2] in {f"blocks.{l}" for l in layers})]
    g.outputs.clear()
    g.outputs.extend(taps)
    blocks = {b.layer: b for b in find_blocks(model)}
    values, stream_type = values_by_name(board), ir.TensorType(stream_dtype(model))
    if hand_on is not None:
        out = Emitter("", graph=g).op("Identity", [values[blocks[hand_on].resid_pre]], STREAM)
        out.type, out.shape = stream_type, ir.Shape(["batch", "pos", "d_model"])
        g.outputs.append(out)
    if resume is not None:
        stream = values[blocks[resume].resid_pre]
        cut = ir.Value(name=RESUME, type=stream_type, shape=ir.Shape(["batch", "pos", "d_model"]))
        for user, i in list(stream.uses()):
            user.replace_input_with(i, cut)
        g.inputs.append(cut)
    RemoveUnusedNodesPass()(board)
    used = [v for v in g.inputs if v.uses()]
    g.inputs.clear()
    g.inputs.extend(used)
    return board


def _fit_taps(board: board_graph.Board, block: BlockMap, on: ir.Value, prefix: str, input_sides: dict[int, Fix]) -> None:
    """Output attn_out, mlp_x, delta, resid_post of a sequential block, with its parallelize switch `on` or off, and
    the mlp's input read from resid_pre and from resid_mid (where its input projections are plain ones); with an input
    side in `input_sides`, the twin mlp, while it reads resid_pre, reads it through that side."""
    g, values, e = board.graph, board.values, board.emitter(prefix)
    mid, pre = values[block.resid_mid], values[block.resid_pre]
    other = e.op("Where", [on, mid, pre], "twin_in")  # the input the mlp branch does not read
    mlp_in = board.mlp_inputs(block)  # before the twin and the taps read ln2's output
    branch = branch_nodes(board.model, block, "mlp", values)
    copies = twin_branch(g, branch, {mid: other}, f"{prefix}/twin")
    top = board.emitter("")
    if not isinstance(mlp_in, str):
        u, twin_u = mlp_in[0], copies[mlp_in[0]]
        readers = {user for user, _ in twin_u.uses()}
        if block.layer in input_sides:
            side = board.emitter(f"{prefix}/twin/mlp_in")
            fixed = input_fixed(board, side, twin_u, input_sides[block.layer])
            redirect_readers(twin_u, side.op("Where", [on, twin_u, fixed], "chosen"), readers)
        # ln2 of resid_pre and of resid_mid, each from a copy of ln2's nodes: whatever the switches, and without
        # reading ln2's own output, which the parallelize switch requires the branch alone to read
        norm = _producers(u, branch)
        for what, source in (("mlp_u", pre), ("mlp_v", mid)):
            value = top.op("Identity", [twin_branch(g, norm, {mid: source}, f"{prefix}/{what}")[u]], fit_tap(block.layer, what))
            value.type = u.type or values[block.resid_pre].type
            g.outputs.append(value)
    own = values[block.mlp_out]
    twin = copies[own]
    on_mid = e.op("Where", [on, twin, own], "mlp_h")
    on_pre = top.op("Where", [on, own, twin], fit_tap(block.layer, "mlp_x"))
    delta = top.op("Sub", [on_mid, on_pre], fit_tap(block.layer, "delta"))
    stream_type = values[block.resid_pre].type
    for what, value in (("attn_out", values[block.attn_out]), ("resid_post", values[block.resid_post])):
        value = top.op("Identity", [value], fit_tap(block.layer, what))
        value.type = stream_type
        g.outputs.append(value)
    for value in (on_pre, delta):
        value.type = stream_type
        g.outputs.append(value)
    o_proj, down_proj = (projection.quantized_node(values[v]) for v in (block.attn_out, block.mlp_out))
    if o_proj is not None and down_proj is not None:  # the inputs of W_o and of the parallel block's W_down
        h = down_proj.inputs[0]
        for what, value in (("o_in", o_proj.inputs[0]), ("down_in", e.op("Where", [on, h, copies[h]], "down_in_x"))):
            value = top.op("Identity", [value], fit_tap(block.layer, what))
            value.type = stream_type
            g.outputs.append(value)


def _producers(value: ir.Value, within: set[ir.Node]) -> set[ir.Node]:
    """The nodes of `within` that `value` is computed by (it and its ancestors there)."""
    found: set[ir.Node] = set()
    todo = [value.producer()]
    while todo:
        node = todo.pop()
        if node is not None and node in within and node not in found:
            found.add(node)
            todo.extend(x.producer() for x in node.inputs if x is not None)
    return found


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
        state: tuple[dict[int, Fix], set[int], set[int]] = ({}, set(), set()),
        streams: list[np.ndarray] | None = None,
        drift: dict[int, list[np.ndarray]] | None = None,
        keep: bool = False,
        progress: Callable[[], None] | None = None,
        weights: list[np.ndarray] | None = None,
        stage: str = "outputs",
    ) -> tuple[dict[int, NormalEquations | InputEquations], list[np.ndarray], dict[int, list[np.ndarray]], dict[str, float]]:
        """The sums of `chunk`'s layers over the windows `ids` (row j is window first + j: fold (first + j) % 2); the
        stream the graph hands on, per window; each layer's resid_post when `keep`; the seconds of forward and
        accumulate. state: the fixes in the graph and the layers switched to parallel and to compensated.
        streams: per window, the stream into the pass's first block (when the graph resumes); drift: this run's
        rows of the drift targets; weights: per window, the tokens' weights (NormalEquations.update). stage `inputs`:
        the input side's sums (InputEquations) of the layers whose graph has its taps (fit_graph(stage="inputs"))."""
        if stage == "inputs":
            return self._run_inputs(chunk, ids, first, switches, streams, progress, weights)
        fixes, parallel_on, fixed_on = state
        sums: dict[int, NormalEquations] = {}
        kept: dict[int, list[np.ndarray]] = {}
        clock, handed = {"forward": 0.0, "accumulate": 0.0}, []
        inputs = {l: [w for w in INPUT_TAPS if fit_tap(l, w) in self.names] for l in chunk}  # as the fit graph has them
        names = [fit_tap(l, w) for l in chunk for w in FIT_TAPS + tuple(inputs[l])]
        for j, out in self._windows(names, ids, switches, streams, clock, handed, progress):
            for layer in chunk:  # token 0, the attention sink, left out
                attn_out, mlp_x, delta, resid_post = (out[fit_tap(layer, w)][0, 1:] for w in FIT_TAPS)
                if keep:
                    kept.setdefault(layer, []).append(resid_post.astype(np.float32))
                if drift is not None:  # target y - (x' + A' + P'), from y' = x' + A' + (P' + delta, P' + fix, or P')
                    correction = delta if layer not in parallel_on else (
                        fixes[layer].apply(attn_out, mlp_x) if layer in fixed_on else 0.0)
                    delta = (drift[layer][j] - resid_post + correction).astype(mlp_x.dtype)
                    resid_post = drift[layer][j]
                if layer not in sums:  # not setdefault: that would allocate a layer's sums on every window
                    sums[layer] = NormalEquations(attn_out.shape[-1])
                sums[layer].update((first + j) % 2, attn_out, mlp_x, delta, resid_post, None if weights is None else weights[j])
                sums[layer].update_inputs({w: out[fit_tap(layer, w)][0, 1:] for w in inputs[layer]})
        return sums, handed, kept, clock

    def _run_inputs(self, chunk, ids, first, switches, streams, progress, weights):
        layers = [l for l in chunk if fit_tap(l, MLP_IN_TAPS[0]) in self.names]
        sums: dict[int, InputEquations] = {}
        clock, handed = {"forward": 0.0, "accumulate": 0.0}, []
        names = [fit_tap(l, w) for l in layers for w in MLP_IN_TAPS]
        for j, out in self._windows(names, ids, switches, streams, clock, handed, progress):
            for layer in layers:  # token 0, the attention sink, left out
                u, v = (out[fit_tap(layer, w)][0, 1:] for w in MLP_IN_TAPS)
                if layer not in sums:
                    sums[layer] = InputEquations(u.shape[-1])
                sums[layer].update((first + j) % 2, u, v, None if weights is None else weights[j])
        return sums, handed, {}, clock

    def _windows(self, names, ids, switches, streams, clock, handed, progress):
        """Run the graph on each window, yielding (row, outputs by name) of `names`: the stream it hands on appended
        to `handed`, the run's seconds to clock["forward"] and, until the next window, the caller's to clock["accumulate"]."""
        fetch = names + ([STREAM] if self.hands_on else [])
        for j in range(len(ids)):
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


def fit(
    model: ir.Model,
    windows: Windows,
    layers: Collection[int] | None = None,
    *,
    fixes: dict[int, Fix] | None = None,
    on: dict[tuple[str, ...], set[int]] | None = None,
    kind: str = "full",
    ridges=RIDGES,
    memory_bytes: int = MEMORY_BYTES,
    options: runtime.Options = runtime.Options(),
    pool: cluster.Pool | None = None,
    progress: Progress | None = None,
    keep_stream: dict[int, list[np.ndarray]] | None = None,
    drift: dict[int, list[np.ndarray]] | None = None,
    seconds: dict[str, float] | None = None,
    requantize: str = "gptq",
    token_weights: list[np.ndarray] | None = None,
    input_side: bool = True,
    input_windows: int | None = None,
) -> dict[int, FitResult]:
    """Fit the fix of each sequential block in `layers` (all when None; a parallel block, or one that
    normalises its branch outputs, asked for is refused; when None, the latter gets no fix) on `windows`: kind `full` (least squares) or `gate` (alpha_l). Each FitResult also carries the
    block's uncompensated scores.

    The layers are fitted in passes over the windows, as many at a time as `memory_bytes` holds (module docstring).
    Each pass runs only its own blocks: it starts from the stream the pass before handed on (kept per window) and
    stops after its last block, so all the passes together cost about one forward pass over the windows.

    fixes / on: the switchboard state to fit under (the sequential refit): `fixes` are the fixes the
    graph holds, `on` the switches turned on, e.g. {("parallelize",): {3, 7}, ("compensate",): {3}}.
    pool: Ray actors (cluster.pool(workers=...)) each accumulate the sums of one contiguous run of the windows, and
    this process adds them in window order; None or an in-process pool: one session here, window by window.
    keep_stream: receives each fitted block's resid_post on every window (token 0 left out, float32), for `drift`.
    drift: the original model's resid_post, as keep_stream kept it on the same windows: fit the drift-correcting
    fix (module docstring) under `fixes` / `on` instead of the defect's.
    seconds: receives where the time went, added to what it holds: forward (the graph's runs), accumulate (the
    float64 sums; on Ray, both summed over the actors) and solve (the ridge choice, the solve and any requantization).
    requantize: where W_o and W_down are MatMulNBits, how the fold's codes are chosen (REQUANTIZE): `gptq`, error-aware
    on the second moments of their inputs gathered in the same pass, or `nearest`.
    token_weights: per window, a weight for each of its tokens 1.. (token 0 is left out): a weighted least squares, of
    both sides.
    input_side: a full fix (not the gate, not the drift fit) also gets an input side (Fix.w_in, b_in), fitted in a pass
    of its own before the output side's, where the mlp's input projections are plain (not MatMulNBits) ones: each
    chunk of layers costs two passes then, the first without the twin mlp; the output side is then fitted to the
    defect left by the input-fixed mlp (module docstring). A block compensated while fitted keeps its fix's input side.
    input_windows: the input side's pass runs on this many of the windows, evenly spaced (all when None): its
    equations have d_model + 1 unknowns per output, the output side's 2 d_model + 1, and its ridge is chosen on the
    same alternating folds of the windows it runs on.
    """
    if requantize not in REQUANTIZE:
        raise SurgeryError(f"unknown requantization {requantize!r}; choose one of {', '.join(REQUANTIZE)}")
    options = dataclasses.replace(options, spinning=False)  # the sums are NumPy work between the runs, on the same cores
    clock = {"forward": 0.0, "accumulate": 0.0, "solve": 0.0} if seconds is None else seconds
    for key in ("forward", "accumulate", "solve"):
        clock.setdefault(key, 0.0)
    if token_weights is not None and [len(w) for w in token_weights] != [windows.seq_len - 1] * len(windows):
        raise SurgeryError(f"token_weights needs one weight per token 1.. of each window: {len(windows)} x {windows.seq_len - 1}")
    if input_windows is not None and input_windows < 1:
        raise SurgeryError(f"input_windows {input_windows}: give a whole number of at least 1")
    if drift is not None and kind != "full":
        raise SurgeryError("the drift-correcting fit needs the full least-squares fix, not the scalar gate")
    blocks = find_blocks(model)
    n, table = len(blocks), embedding_table(model)
    if table is None:
        raise SurgeryError("cannot fit a compensation: found no token embedding table to read d_model from")
    no_fold = {b.layer: _no_fold(model, b) for b in blocks if not b.is_parallel}
    for block in (b for b in blocks if layers is not None and b.layer in layers):
        if block.is_parallel or no_fold[block.layer]:
            raise SurgeryError(refusal(model, block) or (
                f"cannot compensate block {block.layer}: it is parallel already, so there is no sequential-to-parallel "
                "defect to fit; compensate the original sequential model"
            ))
    todo = [b.layer for b in blocks if not b.is_parallel and (layers is None or b.layer in layers)]
    if not todo:
        return {}
    pool = pool or cluster.Pool()
    switches = board_graph.switches(KINDS, n, on)
    state = (fixes or {}, *(set((on or {}).get(kind, ())) for kind in KINDS))
    keep = keep_stream is not None
    results: dict[int, FitResult] = {}
    by_layer = {b.layer: b for b in blocks}
    chunks = _chunks(todo, table[1], memory_bytes, pool.copies, _input_widths(model, todo, requantize))
    values: dict[str, ir.Value] | None = None
    sides = _input_sided(model, todo, skip=state[2]) if input_side and kind == "full" and drift is None else set()
    input_residual: dict[int, float] = {}
    every, inputs_rows = np.arange(len(windows)), spread(len(windows), input_windows)
    done, total = 0, len(chunks) * len(windows) + sum(1 for chunk in chunks if sides.intersection(chunk)) * len(inputs_rows)

    def tick(count: int = 1) -> None:
        nonlocal done
        done += count
        if progress:
            progress(done, total)

    streams: list[np.ndarray] | None = None  # per window: the stream into this pass's first block

    def run_pass(graph: ir.Model, chunk: list[int], streams, stage: str, rows: np.ndarray) -> tuple[dict, list[np.ndarray]]:
        """One pass of `graph` over the windows `rows` (indices, in order): the chunk's sums, added in window order,
        and the streams handed on. Row j of `rows` is in fold j % 2."""
        pick = lambda per_window, r: None if per_window is None else [per_window[i] for i in r]  # noqa: E731

        def job(first: int, r: np.ndarray, progress) -> tuple:  # Accumulator.run's arguments for the rows r
            return (chunk, windows.ids[r], first, switches, state, pick(streams, r),
                    None if drift is None else {l: pick(drift[l], r) for l in chunk}, keep, progress, pick(token_weights, r), stage)

        if pool.distributed:  # one contiguous run of the rows per actor (the input side's run ignores drift and keep)
            runs = [(int(p[0]), rows[p]) for p in np.array_split(np.arange(len(rows)), pool.workers) if len(p)]
            actors = pool.actors(graph, functools.partial(Accumulator, options=pool.options(options)))
            parts = actors.map("run", [job(a, r, None) for a, r in runs])
        else:
            runs = [(0, rows)]
            parts = [Accumulator(graph, options).run(*job(0, rows, tick))]
        sums: dict[int, NormalEquations | InputEquations] = {}
        handed: list[np.ndarray] = []
        for (_, r), (part, stream, kept, part_clock) in zip(runs, parts):  # in window order (in process: one run, all rows)
            start = time.perf_counter()
            for layer, eq in part.items():
                if layer in sums:
                    sums[layer].add(eq)
                else:  # what a Ray actor returned is read-only
                    sums[layer] = eq if eq.zz.flags.writeable else copy.deepcopy(eq)
            handed.extend(stream)
            for layer, kept_streams in kept.items():
                keep_stream.setdefault(layer, []).extend(kept_streams)
            clock["accumulate"] += time.perf_counter() - start
            for key, value in part_clock.items():
                clock[key] += value
            if pool.distributed:
                tick(len(r))
        return sums, handed

    for c, chunk in enumerate(chunks):
        resume, hand_on = chunk[0] if c else None, chunks[c + 1][0] if c + 1 < len(chunks) else None
        sided = [l for l in chunk if l in sides]
        input_sides: dict[int, Fix] = {}
        if sided:  # the input side's pass first, from the same stream; the output side's pass hands it on
            sums, _ = run_pass(fit_graph(model, fixes, sided, resume=resume, stage="inputs"), chunk, streams, "inputs", inputs_rows)
            start = time.perf_counter()
            for layer in sided:
                solved = sums[layer].solve(ridges)
                if solved is not None:
                    input_sides[layer], input_residual[layer] = solved
            clock["solve"] += time.perf_counter() - start
            del sums
        graph = fit_graph(model, fixes, chunk, resume=resume, hand_on=hand_on, inputs=requantize == "gptq", input_sides=input_sides)
        sums, streams = run_pass(graph, chunk, streams, "outputs", every)
        del graph
        start = time.perf_counter()
        for layer in chunk:
            results[layer] = sums[layer].solve(layer, kind, ridges, defect=drift is None)
            if no_fold[layer]:  # scored, but its fix has nowhere to go: the block stays plain
                results[layer] = dataclasses.replace(results[layer], fix=None, note=no_fold[layer])
            elif results[layer].fix is not None:
                # a block compensated while fitted (the refit) keeps its fix's input side, which its mlp read
                side = input_sides.get(layer) or (state[0].get(layer) if layer in state[2] else None)
                if side is not None and side.fixes_input:
                    fix = dataclasses.replace(results[layer].fix, w_in=side.w_in, b_in=side.b_in)
                    results[layer] = dataclasses.replace(results[layer], fix=fix, input_residual=input_residual.get(layer))
                if sums[layer].grams:
                    values = values if values is not None else values_by_name(model)  # once, for the first quantized block
                    fix = requantized(values, by_layer[layer], results[layer].fix, sums[layer].grams)
                    results[layer] = dataclasses.replace(results[layer], fix=fix)
        clock["solve"] += time.perf_counter() - start
        del sums
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


def quantized_outputs(model: ir.Model) -> dict[int, tuple[ir.Node, ir.Node]]:
    """The blocks whose W_o and W_down are both MatMulNBits -> those two nodes; no weight is read."""
    values = values_by_name(model)
    found = {}
    for block in find_blocks(model):
        o_proj, down = (projection.quantized_node(values[v]) for v in (block.attn_out, block.mlp_out))
        if o_proj is not None and down is not None:
            found[block.layer] = (o_proj, down)
    return found


def _input_widths(model: ir.Model, layers: Collection[int], requantize: str = "gptq") -> dict[int, tuple[int, ...]]:
    """Per layer, K of W_o and of W_down where both are MatMulNBits and requantized error-aware (their inputs'
    second moments are gathered in the fit pass)."""
    if requantize != "gptq":
        return {}
    return {l: tuple(int(n.attributes["K"].value) for n in pair) for l, pair in quantized_outputs(model).items() if l in layers}


def requantized(values: dict[str, ir.Value], block: BlockMap, fix: Fix, grams: dict[str, np.ndarray]) -> Fix:
    """`fix` with the codes of W_o (I + w_a) and W_down (I + w_p) chosen error-aware (surgery.nbits) on the second
    moments of their inputs, `grams` (INPUT_TAPS); values: the model's, by name."""
    attn, mlp = projection.outputs(values, block, "compensate")
    (w_o, _), (w_down, _) = fix.fold(attn, mlp)
    packed = tuple(p.quant.packed(p.quant.gptq(w, grams[name])) for p, w, name in ((attn, w_o, "o_in"), (mlp, w_down, "down_in")))
    return dataclasses.replace(fix, packed=packed)


def passes(model: ir.Model, layers: Collection[int] | None = None, memory_bytes: int = MEMORY_BYTES, pool: cluster.Pool | None = None,
           requantize: str = "gptq", kind: str = "full", input_side: bool = True) -> int:
    """How many passes over the fit windows `fit` makes for these layers (all sequential blocks when None), nothing
    compensated yet: one per chunk of layers, and one more for each chunk with an input side to fit."""
    table = embedding_table(model)
    todo = [b.layer for b in find_blocks(model) if not b.is_parallel and (layers is None or b.layer in layers)]
    if not todo or not table:
        return 0
    chunks = _chunks(todo, table[1], memory_bytes, (pool or cluster.Pool()).copies, _input_widths(model, todo, requantize))
    sides = _input_sided(model, todo) if input_side and kind == "full" else set()
    return len(chunks) + sum(1 for chunk in chunks if sides.intersection(chunk))


def _input_sided(model: ir.Model, layers: Collection[int], skip: Collection[int] = ()) -> set[int]:
    """The layers whose fix gets an input side: its mlp's input projections are plain ones (not MatMulNBits), the fix
    folds, and the layer is not in `skip` (compensated already: it keeps its fix's)."""
    values, blocks = values_by_name(model), {b.layer: b for b in find_blocks(model)}
    return {l for l in layers if l not in skip and _no_fold(model, blocks[l]) is None
            and not isinstance(projection.mlp_inputs(model, values, blocks[l]), str)}


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def memory_bound(text: str | int | None) -> int:
    """--fit-memory: bytes the normal equations of one pass may take: `auto` (a quarter of the memory available
    now, at least 256 MiB), or a size such as 512M, 4G, 1.5GiB."""
    if text is None or str(text).strip().lower() == "auto":
        free = available_memory()
        return MEMORY_BYTES if free is None else max(int(MEMORY_SHARE * free), 256 << 20)
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
        if match is None:
            raise SurgeryError(f"cannot read --fit-memory {text!r}: give a size such as 512M or 4G, or auto")
        size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size <= 0:
        raise SurgeryError(f"--fit-memory {text!r}: give a positive size such as 512M or 4G, or auto")
    return size


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now: Linux's MemAvailable (free memory and the page cache
    it can drop, such as the model files just read), else the free pages; None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _no_fold(model: ir.Model, block: BlockMap) -> str | None:
    """Why a fix of this sequential block could not be folded into its weights, or None."""
    if block.post_norm:
        return "branch outputs are normalised: no fold"
    return None if projection.unreadable(model, block, "compensate") is None else "quantized weights that cannot be read: no fold"
