"""The compensation fit's ridge least squares, in NumPy: running float64 sums of the normal equations, the ridge chosen
on a held-out fold, and the solve.

Output side: delta ~ z W with z = [A, P, 1] (A = attn_out, P = the parallel block's mlp output, delta its defect);
input side: v - u ~ [u, 1] W_in (u, v: ln2 of resid_pre and of resid_mid as the mlp's input projections read them).

    W = (Z'Z + ridge * diag(Z'Z))^-1 Z'delta        (float64)

Windows alternate between two folds; the ridge is the one whose fit on fold 0 leaves the least target energy on
fold 1, and the final fit uses both folds. One window's products are formed in the activations' own precision (at
least float32) and added to the float64 sums. The graphs these sums are read from are surgery.analysis.fit_graph's;
the passes that run them, surgery.compensation.fitting's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

from surgery.analysis import defect
from surgery.files.checkpoint import checkpointable
from surgery.passes.fix import Fix

RIDGES = (1e-8, 1e-6, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 0.3, 1.0, 3.0)  # times diag(Z'Z); chosen per layer on the held-out fold


@checkpointable
@dataclasses.dataclass(frozen=True)
class FitResult:
    """One block's fitted fix and how well it generalises. fix is None when the fit failed (note says why).

    Held-out numbers are of the fit on fold 0 measured on fold 1 of the fit windows (windows alternate between the folds).

    Attributes:
        layer: the block, by index from 0.
        fix: the Fix to hand to `compensate` or `fuse` (a gate for kind `gate`); None when the fit failed or cannot be folded into the weights.
        ridge: the ridge strength chosen on the held-out fold (times diag(Z'Z)); None for a gate or a failed fit.
        residual: held-out E|delta - fit|^2 / E|delta|^2, delta the block's defect (of the input-fixed block, with an input side); below 1: the fix helps.
        c_comp: C_l^comp, held-out E|delta - fit|^2 / E|y|^2: the fixed block's defect, what `select_layers` ranks by when compensating.
        tokens: the tokens the sums were gathered on (both folds).
        note: why fix is None (empty when it is not).
        scores: the uncompensated one-pass scores on the fit windows: c, c_stream, alpha.
        input_residual: of the input side, held-out E|v - u'|^2 / E|v - u|^2; None without an input side.
    """

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
        """C_l^stream = E|delta|^2 / E|y|^2 on the fit windows: the uncompensated score (scores["c_stream"])."""
        return self.scores["c_stream"]

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fix"}


def fixes(fits: dict[int, FitResult]) -> dict[int, Fix]:
    """The fitted fix of each layer, by layer (a layer whose fit gave none left out)."""
    return {layer: f.fix for layer, f in fits.items() if f.fix is not None}


class _Sums:
    """One block's running sums of a ridge least squares target ~ z W (z's last column 1), per fold, in float64."""

    def __init__(self, k: int, d_model: int):
        self.zz = np.zeros((2, k, k))
        self.zd = np.zeros((2, k, d_model))
        self.dd = np.zeros(2)  # sum |target|^2
        self.tokens = np.zeros(2, dtype=np.int64)

    def _accumulate(self, fold: int, z: np.ndarray, target: np.ndarray) -> None:
        """Add z'z, z'target and |target|^2 to the fold's sums, products in z's precision."""
        energy = target.astype(np.float64) ** 2
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite activations are refused in solve()
            self.zz[fold] += z.T @ z
            self.zd[fold] += z.T @ target
        self.dd[fold] += float(np.sum(energy))
        self.tokens[fold] += len(z)

    @property
    def nbytes_held(self) -> int:
        """The bytes these sums take (what a snapshot of them writes)."""
        arrays = [a for a in vars(self).values() if isinstance(a, np.ndarray)] + list(getattr(self, "grams", {}).values())
        return sum(a.nbytes for a in arrays)

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


@checkpointable
class NormalEquations(_Sums):
    """One block's running sums for delta ~ [A, P, 1] W, per fold, in float64."""

    def __init__(self, d_model: int):
        super().__init__(2 * d_model + 1, d_model)
        self.yy = np.zeros(2)  # sum |resid_post|^2
        self.grams: dict[str, np.ndarray] = {}  # the fit graph's INPUT_TAPS -> sum x x' over both folds (quantized W_o, W_down)

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

    def update(self, fold: int, attn_out: np.ndarray, mlp_x: np.ndarray, delta: np.ndarray, resid_post: np.ndarray) -> None:
        """Add tokens: each argument [tokens, d_model]; delta is the fit's target, the defect. One window's products
        are formed in the activations' own precision (at least float32, what ORT computed them in) and added to the
        float64 sums, so the sums carry no error the activations do not already have."""
        dtype = np.result_type(attn_out, mlp_x, delta, np.float32)
        z = np.concatenate([attn_out, mlp_x, np.ones((len(delta), 1))], axis=1, dtype=dtype)
        self._accumulate(fold, z, delta.astype(dtype))
        self.yy[fold] += float(np.sum(resid_post.astype(np.float64) ** 2))

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

    def solve(self, layer: int, kind: str = "full", ridges=RIDGES) -> FitResult:
        """The fix of one block: `full` (ridge least squares, the ridge chosen on the held-out fold,
        then refitted on both folds) or `gate` (alpha_l, the paper's scalar). A fit that is not
        finite is refused (fix None, with a note). The one-pass scores (C_l, C_l^stream, alpha_l) are read off the sums."""
        d = self.zd.shape[2]
        tokens, scores = int(self.tokens.sum()), self.scores()
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


@checkpointable
class InputEquations(_Sums):
    """One block's running sums for the input side, v - u ~ [u, 1] W with u = ln2(resid_pre) and v = ln2(resid_mid) as
    the mlp's input projections read them, per fold, in float64: Fix.w_in and b_in, so that the parallel block's mlp
    reads a linear prediction of its sequential input."""

    def __init__(self, d_model: int):
        super().__init__(d_model + 1, d_model)

    def update(self, fold: int, u: np.ndarray, v: np.ndarray) -> None:
        """Add tokens ([tokens, d_model] each), products in the activations' precision (at least float32)."""
        dtype = np.result_type(u, v, np.float32)
        z = np.concatenate([u, np.ones((len(u), 1))], axis=1, dtype=dtype)
        self._accumulate(fold, z, v.astype(dtype) - u.astype(dtype))

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

