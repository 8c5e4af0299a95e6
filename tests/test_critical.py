import copy

import numpy as np
import pytest

from surgery.analysis import field as field_graph
from surgery.diagnostics.critical import classify, find_critical_points, fixed_points, tangent_basis, tangent_jacobians
from surgery.diagnostics.geometry import unit
from surgery.engine import runtime
from surgery.files import graph
from surgery.model.blocks import find_blocks


def _symmetric(spectrum, seed=0):
    """M = Q diag(spectrum) Q^T with a random orthogonal Q; returns M and Q (eigenvectors as columns)."""
    q = np.linalg.qr(np.random.default_rng(seed).standard_normal((len(spectrum), len(spectrum))))[0]
    return q @ np.diag(spectrum) @ q.T, q


@pytest.mark.parametrize("spectrum, kind", [((-1.0, 0.5, 1.0, 2.0, 4.0), "attractor"), ((-4.0, -1.0, 0.5, 1.0, 2.0), "repeller")])
def test_linear_field_search_reaches_the_dominant_eigenvector(spectrum, kind):
    """f(z) = M z, M symmetric: F(u) = P_u M u vanishes at +-q_k with tangent eigenvalues r (a_j - a_k). The iteration
    u <- unit(+-M u) is the power method: every run ends at +-q of the eigenvalue largest in size, an attractor when
    that eigenvalue is positive and a repeller when it is negative."""
    m, q = _symmetric(spectrum)
    a, r = np.array(spectrum), 2.0
    top = int(np.argmax(np.abs(a)))
    search = find_critical_points(lambda z: z @ m.T, np.random.default_rng(1).standard_normal((12, 5)), r)
    assert search.seeds == 12 and search.converged == 12 and search.best_residual < 1e-3
    assert 1 <= len(search.points) <= 2  # +q and -q at most
    expected = r * (np.delete(a, top) - a[top])
    for p in search.points:
        assert abs(np.dot(p.direction, q[:, top])) > 1 - 1e-5
        assert p.kind == kind and p.residual < 1e-3
        assert p.max_real == pytest.approx(expected.max(), rel=1e-2) and p.min_real == pytest.approx(expected.min(), rel=1e-2)
        assert p.unstable_dims == (4 if kind == "repeller" else 0)


def test_tangent_jacobians_classify_the_zeros_of_a_linear_field():
    """f(z) = diag(1, 2, 3) z on S^2: at e_k the tangent eigenvalues are r (a_j - a_k), so e_3 attracts, e_2 is a
    saddle, e_1 repels; all three Jacobians come from one evaluation."""
    a, r = np.array([1.0, 2.0, 3.0]), 2.0
    calls = []
    jacobians = tangent_jacobians(lambda z: calls.append(len(z)) or z * a, np.eye(3), r)
    assert calls == [9]  # 3 points + 3 x 2 tangent steps
    for k, (kind, max_real, min_real, unstable) in enumerate(classify(jacobians)):
        expected = r * (np.delete(a, k) - a[k])
        assert kind == ("repeller", "saddle", "attractor")[k] and unstable == (expected > 0).sum()
        assert (max_real, min_real) == pytest.approx((expected.max(), expected.min()), rel=1e-2)


def test_batched_search_equals_one_seed_at_a_time():
    rng = np.random.default_rng(2)
    w1, w2, b = rng.standard_normal((16, 6)), rng.standard_normal((6, 16)), rng.standard_normal(6)
    calls = []

    def f(z):  # a nonlinear field on R^6
        calls.append(len(z))
        return np.tanh(z @ w1.T) @ w2.T + 2 * b

    seeds = unit(rng.standard_normal((7, 6)))
    signs = np.where(np.arange(7) % 2 == 0, 1.0, -1.0)
    u, res = fixed_points(f, seeds, 1.5, signs, 40, 1e-6)
    assert (res < 1e-6).sum() >= 2 and (res >= 1e-6).sum() >= 2  # finished and unfinished runs both compared
    batched, steps = len(calls), []
    for i in range(7):
        before = len(calls)
        ui, ri = fixed_points(f, seeds[i : i + 1], 1.5, signs[i : i + 1], 40, 1e-6)
        steps.append(len(calls) - before)
        np.testing.assert_allclose(ui[0], u[i], atol=1e-10)
        assert ri[0] == pytest.approx(res[i], abs=1e-10)
    assert batched == max(steps)  # one call per step evaluated every unfinished seed
    single = np.stack([tangent_jacobians(f, u[i : i + 1], 1.5)[0] for i in range(7)])
    np.testing.assert_allclose(tangent_jacobians(f, u, 1.5), single, atol=1e-8)


def test_tangent_basis_is_orthonormal_and_orthogonal_to_u():
    u = np.random.default_rng(1).standard_normal(7)
    u /= np.linalg.norm(u)
    q = tangent_basis(u)
    np.testing.assert_allclose(q.T @ q, np.eye(6), atol=1e-12)
    np.testing.assert_allclose(q.T @ u, 0, atol=1e-12)


def test_zeros_found_through_a_tiny_gpt2_field_graph_are_zeros_of_the_torch_mlp(fixture_path):
    """The committed tiny-gpt2 is tiny_model('gpt2', seed=0) exported: at every zero the search reports through ORT,
    that model's torch mlp(ln_2(r u)) is parallel to u, and its autograd tangent Jacobian has the reported spectrum."""
    torch = pytest.importorskip("torch")
    from graphs.make_fixtures import tiny_model

    model = graph.load(fixture_path("gpt2"))
    reference = tiny_model("gpt2", seed=0)
    r, found = 8.0, 0
    for block in find_blocks(model):
        sess = runtime.session(field_graph.field(model, block))
        search = find_critical_points(
            lambda z: sess.run(None, {field_graph.FIELD_IN: z[:, None].astype(np.float32)})[0][:, 0],
            np.random.default_rng(block.layer).standard_normal((4, 64)), r,
        )
        layer = copy.deepcopy(reference.transformer.h[block.layer]).double()

        def g(z, layer=layer):
            return layer.mlp(layer.ln_2(z))

        for p in search.points:
            u = np.array(p.direction)
            z = torch.tensor(r * u)
            with torch.no_grad():
                out = g(z).numpy()
            lam = out @ u
            assert np.linalg.norm(out - lam * u) / np.linalg.norm(out) == pytest.approx(p.residual, rel=0.05)
            q = tangent_basis(u)
            jacobian = r * q.T @ torch.autograd.functional.jacobian(g, z).numpy() @ q - lam * np.eye(63)
            real = np.linalg.eigvals(jacobian).real
            assert (p.max_real, p.min_real) == pytest.approx((real.max(), real.min()), rel=1e-2)
            assert p.unstable_dims == (real > 0).sum()
            found += 1
    assert found >= 3  # every layer has at least one zero

