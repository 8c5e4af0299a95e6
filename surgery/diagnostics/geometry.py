"""Angular deficit and token diversity from residual tensors (NumPy). Token 0, the attention sink, is left out by callers."""

from __future__ import annotations

import numpy as np

_TINY = 1e-30


def unit(x: np.ndarray) -> np.ndarray:
    """Directions along the last axis: x / |x|."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), _TINY)


def tangential(z: np.ndarray, u: np.ndarray) -> np.ndarray:
    """P_u z = z - <u, z> u for unit u."""
    return z - np.sum(z * u, axis=-1, keepdims=True) * u


def alignment(resid_pre: np.ndarray, attn_out: np.ndarray, resid_post: np.ndarray) -> np.ndarray:
    """Per token cos(P_u A, P_u (y - x)), u = x / |x|: how much of the block's angular motion attention explains."""
    x, a, y = (t.astype(np.float64) for t in (resid_pre, attn_out, resid_post))
    u = unit(x)
    pa, pd = tangential(a, u), tangential(y - x, u)
    denom = np.linalg.norm(pa, axis=-1) * np.linalg.norm(pd, axis=-1)
    return np.sum(pa * pd, axis=-1) / np.maximum(denom, _TINY)


def mean_pairwise_cosine(x: np.ndarray) -> float:
    """MPC of the n directions in x [n, d]: (|sum u_i|^2 - n) / (n (n - 1))."""
    u = unit(x.astype(np.float64))
    n = len(u)
    return float((np.sum(np.sum(u, axis=0) ** 2) - n) / (n * (n - 1)))


def effective_rank(x: np.ndarray) -> float:
    """exp(entropy of the normalised singular values) of the n x d matrix of directions."""
    u = unit(x.astype(np.float64))
    gram = u @ u.T if u.shape[0] <= u.shape[1] else u.T @ u  # its eigenvalues are the squared singular values
    s = np.sqrt(np.clip(np.linalg.eigvalsh(gram), 0, None))
    p = s / s.sum()
    p = p[p > 0]
    return float(np.exp(-np.sum(p * np.log(p))))
