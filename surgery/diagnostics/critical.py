"""Critical points of a block's mlp field on the sphere: F(u) = P_u g(r u), g = mlp(ln2(.)).

F vanishes where the mlp output is parallel to u: g(r u) = lambda u. Zeros are found by the field's own
fixed-point iteration u <- unit(s g(r u)) from data seeds, s = +1 from every other seed and s = -1 from
the rest, all runs of a layer evaluated in one call per step. Near a zero with s lambda > 0 a step is
an Euler step of du/dt = F(u) of length 1/|lambda|, forward for s = +1 and backward for s = -1 (near
one with s lambda < 0 it jumps to about -u): with F's tangent Jacobian M - lambda I there, the step's
derivative is M / lambda. So it converges to the attractors (lambda > 0) and the repellers
(lambda < 0) whose M has spectral radius below |lambda|, and to no saddle. Levenberg-Marquardt from the same seeds, which
could reach saddles, does not pay on SmolLM2 (benchmarks/RESULTS.md): on |F| it runs into regions where
the whole mlp output vanishes (|g| ~1e-3 of its size at the seeds, F still orthogonal to u), on
|F| / |g| no seed of layers 5, 20, 29 got below 1e-3 in 30 full Jacobians.

At each distinct zero the Jacobian of F restricted to the tangent space (forward differences, all zeros
in one evaluation) decides the type: every eigenvalue's real part < 0 attractor, > 0 repeller, otherwise
saddle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from surgery.diagnostics.geometry import tangential, unit

KINDS = ("attractor", "saddle", "repeller")
Field = Callable[[np.ndarray], np.ndarray]  # f: [N, d] -> [N, d], the mlp branch applied to points
_TINY = 1e-30


@dataclasses.dataclass(frozen=True)
class CriticalPoint:
    kind: str
    residual: float  # |F(u)| / |g(r u)|: sine of the angle between the mlp output and u
    max_real: float  # largest eigenvalue real part of the tangent Jacobian
    min_real: float
    unstable_dims: int  # eigenvalues with positive real part
    direction: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Search:
    seeds: int  # data seeds, one fixed-point run each
    converged: int  # runs that ended with residual < tol
    best_residual: float  # the smallest residual any run ended with
    points: tuple[CriticalPoint, ...]  # the distinct zeros, classified

    def counts(self) -> dict[str, int]:
        return {k: sum(p.kind == k for p in self.points) for k in KINDS}


def tangent_field(f: Field, u: np.ndarray, r: float) -> np.ndarray:
    """F at unit points u [N, d]: the tangential part of f(r u)."""
    return tangential(f(r * u).astype(np.float64), u)


def residuals(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """|P_u g| / |g| per row of g, u [N, d]: 0 exactly where the mlp output g is parallel to u."""
    return np.linalg.norm(tangential(g, u), axis=-1) / np.maximum(np.linalg.norm(g, axis=-1), _TINY)


def fixed_points(f: Field, seeds: np.ndarray, r: float, signs: np.ndarray, iterations: int, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Iterate u <- unit(sign f(r u)) from each unit seed [N, d] until its residual is below tol, at most
    `iterations` steps; every unfinished run is evaluated in one call per step. Returns the last points
    [N, d] and their residuals [N]."""
    u, res = seeds.copy(), np.full(len(seeds), np.inf)
    todo = np.arange(len(u))
    for step in range(iterations + 1):
        g = f(r * u[todo]).astype(np.float64)
        res[todo] = residuals(g, u[todo])
        going = res[todo] >= tol
        todo, g = todo[going], g[going]
        if step == iterations or not len(todo):
            break
        u[todo] = unit(signs[todo, None] * g)
    return u, res


def tangent_basis(u: np.ndarray) -> np.ndarray:
    """d x (d-1) orthonormal basis of the plane orthogonal to unit u (Householder reflection of e_0 onto u)."""
    d = len(u)
    e = np.zeros(d)
    e[0] = 1.0
    v = u - e if np.linalg.norm(u - e) > 1e-8 else u + e
    v /= np.linalg.norm(v)
    h = np.eye(d) - 2.0 * np.outer(v, v)  # orthogonal, maps e_0 to +-u
    return h[:, 1:]


def tangent_jacobians(f: Field, u: np.ndarray, r: float, eps: float = 1e-3) -> np.ndarray:
    """[k, d-1, d-1] Jacobians of F at unit points u [k, d], each in its tangent basis, by forward differences
    along the sphere: k d points in one evaluation."""
    k, d = u.shape
    q = np.stack([tangent_basis(p) for p in u])  # [k, d, d-1]
    steps = unit(u[:, None] + eps * np.swapaxes(q, 1, 2))  # [k, d-1, d]: row j is u moved along basis vector j
    values = tangent_field(f, np.concatenate([u, steps.reshape(-1, d)]), r)
    difference = (values[k:].reshape(k, d - 1, d) - values[:k, None]) / eps  # [k, d-1, d]: row j is dF along basis vector j
    return np.swapaxes(q, 1, 2) @ np.swapaxes(difference, 1, 2)


def classify(jacobians: np.ndarray) -> list[tuple[str, float, float, int]]:
    """Kind, largest and smallest eigenvalue real part, and the number of positive ones, of each tangent
    Jacobian [k, n, n]."""
    real = np.linalg.eigvals(jacobians).real
    kinds = ["attractor" if (x < 0).all() else "repeller" if (x > 0).all() else "saddle" for x in real]
    return [(k, float(x.max()), float(x.min()), int((x > 0).sum())) for k, x in zip(kinds, real)]


def find_critical_points(
    f: Field, seeds: np.ndarray, r: float, *, iterations: int = 200, tol: float = 1e-3, eps: float = 1e-3
) -> Search:
    """Run the fixed-point iteration from each seed direction [N, d], with sign +1 from even and -1 from odd
    seeds; return the distinct zeros it reached (residual < tol; u and -u are different zeros), best first,
    classified."""
    seeds = unit(seeds.astype(np.float64))
    signs = np.where(np.arange(len(seeds)) % 2 == 0, 1.0, -1.0)
    u, res = fixed_points(f, seeds, r, signs, iterations, tol)
    distinct: list[int] = []
    for i in np.argsort(res):
        if res[i] < tol and all(u[i] @ u[j] < 0.999 for j in distinct):
            distinct.append(i)
    with threadpool_limits(1, user_api="blas"):  # small eigenproblems: BLAS threads cost more than they give
        kinds = classify(tangent_jacobians(f, u[distinct], r, eps)) if distinct else []
    points = tuple(
        CriticalPoint(kind, float(res[i]), max_real, min_real, unstable, tuple(u[i]))
        for i, (kind, max_real, min_real, unstable) in zip(distinct, kinds)
    )
    return Search(len(seeds), int((res < tol).sum()), float(res.min()), points)
