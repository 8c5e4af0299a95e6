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
        def column(num, den):
            return [float(s[num] / s[den]) if seen else None for s, seen in zip(self.sums, self.seen)]

        return {"c": column(0, 1), "c_stream": column(0, 2), "alpha": column(3, 4)}


def spearman(a, b) -> float | None:
    """Spearman rank correlation of two sequences (None entries dropped pairwise; average ranks for ties)."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    ra, rb = (_ranks(np.array(v, dtype=np.float64)) for v in zip(*pairs))
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v), dtype=np.float64)
    for value in np.unique(v):  # ties share their mean rank
        tied = v == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def scores(model, windows, options=None, progress=None) -> dict[str, list[float | None]]:
    """C_l, C_l^stream and alpha_l of every block from one pass of the probe graph over `windows`."""
    from surgery import runtime
    from surgery.diagnostics.graphs import probe

    p = probe(model, tensors=("mlp_out", "resid_post"), twin=True)
    sess = runtime.session(p.model, options or runtime.Options())
    names = [o.name for o in sess.get_outputs()]
    stats = DefectStats(len(p.outputs))
    for i in range(len(windows)):
        out = dict(zip(names, sess.run(None, runtime.feeds(sess, windows.ids[i : i + 1]))))
        for layer, o in enumerate(p.outputs):
            if "mlp_out_on_pre" in o:  # token 0, the attention sink, left out
                stats.update(layer, out[o["mlp_out"]][0, 1:], out[o["mlp_out_on_pre"]][0, 1:], out[o["resid_post"]][0, 1:])
        if progress:
            progress(i + 1, len(windows))
    return stats.result()
