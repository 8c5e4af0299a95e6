"""Prefix sensitivity: S_l(d) = E |y_t - y'_t| / |y_t|, y' computed with the token at t - d replaced."""

from __future__ import annotations

import numpy as np

from surgery.engine import runtime


def distances(seq_len: int) -> list[int]:
    """Powers of two that fit before the last position without touching BOS / position 0."""
    out, d = [], 1
    while d <= seq_len - 2:
        out.append(d)
        d *= 2
    return out


def sensitivity(sess, resid_post: list[str], ids: np.ndarray, dists: list[int], vocab: int, rng: np.random.Generator) -> np.ndarray:
    """[n_layers, len(dists)] relative change of resid_post at the last position of each window in `ids`
    when the token d positions earlier is replaced by a random other token; averaged over windows."""
    total = np.zeros((len(resid_post), len(dists)))
    t = ids.shape[1] - 1
    for row in ids:
        batch = np.repeat(row[None], len(dists) + 1, axis=0)
        for k, d in enumerate(dists, start=1):
            batch[k, t - d] = (row[t - d] + rng.integers(1, vocab)) % vocab  # a different token
        outs = sess.run(resid_post, runtime.feeds(sess, batch))
        for layer, y in enumerate(outs):
            y = y[:, t].astype(np.float64)  # [1 + len(dists), d_model]
            total[layer] += np.linalg.norm(y[1:] - y[0], axis=-1) / np.linalg.norm(y[0])
    return total / len(ids)
