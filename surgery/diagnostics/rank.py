"""How well a score ranks the layers by a measured loss: Spearman rank correlation."""

from __future__ import annotations

import numpy as np


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
