"""The sequential-to-parallel defect and gate calibration, streamed window by window.

delta_l = mlp(ln2(h)) - mlp(ln2(x)) on the same tokens;
C_l = E|delta|^2 / E|mlp(ln2 h)|^2, C_l^stream = E|delta|^2 / E|y|^2,
alpha_l = E<mlp(ln2 h), mlp(ln2 x)> / E|mlp(ln2 x)|^2 (least squares gate for the parallel block).
"""

from __future__ import annotations

import numpy as np


class DefectStats:
    """Running sums of the defect terms per layer; None for layers that are already parallel."""

    def __init__(self, n_layers: int):
        self.sums = np.zeros((n_layers, 5))  # |delta|^2, |mlp_h|^2, |y|^2, <mlp_h, mlp_x>, |mlp_x|^2
        self.seen = np.zeros(n_layers, dtype=bool)

    def update(self, layer: int, mlp_h: np.ndarray, mlp_x: np.ndarray, resid_post: np.ndarray) -> None:
        """Add tokens (any leading shape, last axis d_model)."""
        h, x, y = (t.astype(np.float64) for t in (mlp_h, mlp_x, resid_post))
        self.sums[layer] += [np.sum((h - x) ** 2), np.sum(h**2), np.sum(y**2), np.sum(h * x), np.sum(x**2)]
        self.seen[layer] = True

    def add(self, layer: int, sums: np.ndarray) -> None:
        """Add the five sums of `update` computed elsewhere (in the probe graph)."""
        self.sums[layer] += sums
        self.seen[layer] = True

    def result(self) -> dict[str, list[float | None]]:
        """Per layer (None where never updated): c, c_stream, alpha."""
        rows = [ratios(*s) if seen else None for s, seen in zip(self.sums, self.seen)]
        return {k: [None if r is None else r[k] for r in rows] for k in ("c", "c_stream", "alpha")}


def ratios(dd: float, hh: float, yy: float, hx: float, xx: float) -> dict[str, float]:
    """C_l, C_l^stream and alpha_l from sums over tokens of |delta|^2, |mlp(ln2 h)|^2, |y|^2,
    <mlp(ln2 h), mlp(ln2 x)> and |mlp(ln2 x)|^2: the one place they are defined."""
    tiny = 1e-300
    return {"c": float(dd / max(hh, tiny)), "c_stream": float(dd / max(yy, tiny)), "alpha": float(hx / max(xx, tiny))}
