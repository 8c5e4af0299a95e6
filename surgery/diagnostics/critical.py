"""Critical points of a block's mlp field on the sphere: F(u) = P_u mlp(ln2(r u)).

Zeros are found by damped Newton steps in the tangent space, from data seeds; at each zero the
Jacobian of F restricted to the tangent space (central differences, one batched evaluation)
decides the type: every eigenvalue's real part < 0 attractor, > 0 repeller, otherwise saddle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from surgery.diagnostics.geometry import tangential, unit

KINDS = ("attractor", "saddle", "repeller")
Field = Callable[[np.ndarray], np.ndarray]  # f: [N, d] -> [N, d], the mlp branch applied to points


@dataclasses.dataclass(frozen=True)
class CriticalPoint:
    kind: str
    residual: float  # |F(u)| / median |F(seed)|
    max_real: float  # largest eigenvalue real part of the tangent Jacobian
    min_real: float
    unstable_dims: int  # eigenvalues with positive real part
    direction: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Search:
    seeds: int
    points: tuple[CriticalPoint, ...]

    def counts(self) -> dict[str, int]:
        return {k: sum(p.kind == k for p in self.points) for k in KINDS}


def tangent_field(f: Field, u: np.ndarray, r: float) -> np.ndarray:
    """F at unit points u [N, d]: the tangential part of f(r u)."""
    return tangential(f(r * u).astype(np.float64), u)


def tangent_basis(u: np.ndarray) -> np.ndarray:
    """d x (d-1) orthonormal basis of the plane orthogonal to unit u (Householder reflection of e_0 onto u)."""
    d = len(u)
    e = np.zeros(d)
    e[0] = 1.0
    v = u - e if np.linalg.norm(u - e) > 1e-8 else u + e
    v /= np.linalg.norm(v)
    h = np.eye(d) - 2.0 * np.outer(v, v)  # orthogonal, maps e_0 to +-u
    return h[:, 1:]


def tangent_jacobian(f: Field, u: np.ndarray, r: float, eps: float = 1e-3) -> np.ndarray:
    """(d-1) x (d-1) Jacobian of F at u in the tangent basis, by central differences along the sphere."""
    q = tangent_basis(u)
    steps = np.concatenate([unit(u + eps * q.T), unit(u - eps * q.T)])  # [2(d-1), d]
    values = tangent_field(f, steps, r)
    plus, minus = values[: q.shape[1]], values[q.shape[1] :]
    return q.T @ ((plus - minus) / (2 * eps)).T


def find_critical_points(
    f: Field, seeds: np.ndarray, r: float, *, iterations: int = 15, tol: float = 1e-3, eps: float = 1e-3
) -> Search:
    """Newton-search zeros of F from each seed direction; return the distinct ones, classified."""
    seeds = unit(seeds.astype(np.float64))
    scale = float(np.median(np.linalg.norm(tangent_field(f, seeds, r), axis=-1))) or 1.0
    found: list[CriticalPoint] = []
    for seed in seeds:
        u = seed
        residual = np.linalg.norm(tangent_field(f, u[None], r)[0]) / scale
        for _ in range(iterations):
            if residual < tol:
                break
            q = tangent_basis(u)
            jac = tangent_jacobian(f, u, r, eps)
            step = np.linalg.lstsq(jac, -(q.T @ tangent_field(f, u[None], r)[0]), rcond=None)[0]
            for _ in range(6):  # backtrack until |F| drops
                trial = unit(u + q @ step)
                trial_residual = np.linalg.norm(tangent_field(f, trial[None], r)[0]) / scale
                if trial_residual < residual:
                    break
                step = step / 2
            else:
                break
            u, residual = trial, trial_residual
        if residual >= tol or any(np.dot(u, p.direction) > 0.999 for p in found):
            continue
        real = np.linalg.eigvals(tangent_jacobian(f, u, r, eps)).real
        kind = "attractor" if (real < 0).all() else "repeller" if (real > 0).all() else "saddle"
        found.append(CriticalPoint(kind, float(residual), float(real.max()), float(real.min()), int((real > 0).sum()), tuple(u)))
    return Search(len(seeds), tuple(found))
