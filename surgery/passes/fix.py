"""Fix: a linear fix of a parallel block's defect, which the compensate and fuse passes fold into the weights
(surgery.passes.fold)."""

from __future__ import annotations

import dataclasses

import numpy as np

from surgery.files.checkpoint import checkpointable


@checkpointable
@dataclasses.dataclass(frozen=True)
class Fix:
    """A linear fix of a parallel block, folded into its weights: on the output side, into the output projections,

        resid_post = resid_pre + attn_out (I + w_a) + mlp_out (I + w_p) + b

    and on the input side, into the mlp's input projections (W_gate and W_up, or W_fc): the mlp reads
    u (I + w_in) + b_in instead of u = ln2(resid_pre), a linear prediction of ln2(resid_mid), the input it had in the
    sequential block (W <- (I + w_in) W, b <- b + b_in W). mlp_out is the output of that input-fixed mlp.

    Fix() changes nothing; Fix.gate(alpha) is the paper's calibrated parallel block; `surgery.fit` gives the least
    squares one (FitResult.fix). Hand fixes to `compensate` or `fuse`, by layer.

    Attributes:
        w_a: [d_model, d_model] array: attn_out (I + w_a); None means 0.
        w_p: [d_model, d_model] array, or a number (w_p I): mlp_out (I + w_p); None means 0.
        b: [d_model] array added to resid_post; None means 0.
        packed: for MatMulNBits output projections, the codes of W_o (I + w_a) and W_down (I + w_p) as the node stores
            them, chosen error-aware by the fit (surgery.model.nbits); None: a fold rounds them to nearest.
        w_in: [d_model, d_model] array of the input side: the mlp reads u (I + w_in) + b_in; None means 0.
        b_in: [d_model] array of the input side; None means 0.
        packed_in: for MatMulNBits mlp input projections, the codes of (I + w_in) W of each (in fold.input_projections'
            order), chosen error-aware by the fit; () or None for one: a fold rounds it to nearest.
    """

    w_a: np.ndarray | None = None
    w_p: np.ndarray | float | None = None
    b: np.ndarray | None = None
    packed: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
    w_in: np.ndarray | None = None
    b_in: np.ndarray | None = None
    packed_in: tuple[np.ndarray | None, ...] = ()

    @classmethod
    def gate(cls, alpha: float) -> "Fix":
        """The paper's calibrated parallel block: mlp_out scaled by alpha (alpha_l, FitResult.scores["alpha"]).

        Args:
            alpha: the factor of mlp_out; 1 changes nothing.

        Returns:
            Fix(w_p=alpha - 1), which `describe` calls `calibrated x<alpha>`.
        """
        return cls(w_p=float(alpha) - 1.0)

    @property
    def is_identity(self) -> bool:
        """The fix changes nothing: no w_a, b or input side, and w_p None or the number 0."""
        return (self.w_a is None and self.b is None and (self.w_p is None or (np.isscalar(self.w_p) and self.w_p == 0))
                and not self.fixes_input)

    @property
    def fixes_input(self) -> bool:
        """The fix changes what the mlp reads (w_in or b_in given)."""
        return self.w_in is not None or self.b_in is not None

    def apply(self, attn_out: np.ndarray, mlp_out: np.ndarray) -> np.ndarray:
        """What the fix adds to the residual stream: attn_out w_a + mlp_out w_p + b (the output side only).

        Args:
            attn_out: the block's attn_out, [tokens, d_model].
            mlp_out: its mlp_out, [tokens, d_model] (of the input-fixed mlp when the fix has an input side).

        Returns:
            A float64 array of mlp_out's shape, [tokens, d_model]; zeros for a fix with no output side.
        """
        total = np.zeros(np.shape(mlp_out), np.float64)
        if self.w_a is not None:
            total += np.asarray(attn_out, np.float64) @ self.w_a
        if self.w_p is not None:
            total += np.asarray(mlp_out, np.float64) * self.w_p if np.isscalar(self.w_p) else np.asarray(mlp_out, np.float64) @ self.w_p
        if self.b is not None:
            total += self.b
        return total

    def describe(self) -> str:
        """How the model's history and a Change name the fix: `calibrated x0.8812` for a gate (w_p a number or None and
        nothing else), `compensated` for a full fix (with or without an input side)."""
        if self.w_a is None and self.b is None and (self.w_p is None or np.isscalar(self.w_p)) and not self.fixes_input:
            return f"calibrated x{1.0 + float(self.w_p or 0.0):.4f}"
        return "compensated"

