import numpy as np
import pytest

from surgery.analysis.defect import DefectStats
from surgery.diagnostics.geometry import alignment, effective_rank, mean_pairwise_cosine
from surgery.diagnostics.rank import spearman


def test_alignment_and_diversity_on_hand_made_vectors():
    x = np.array([[1.0, 0, 0], [1.0, 0, 0]])
    a = np.array([[5.0, 1, 0], [0, 0, 1]])
    y = x + np.array([[3.0, 2, 0], [0, 1, 0]])
    np.testing.assert_allclose(alignment(x, a, y), [1.0, 0.0], atol=1e-12)  # radial parts do not count
    same = np.ones((4, 3))
    assert mean_pairwise_cosine(same) == pytest.approx(1.0)
    assert effective_rank(same) == pytest.approx(1.0)
    eye = np.eye(3)
    assert mean_pairwise_cosine(eye) == pytest.approx(0.0)
    assert effective_rank(eye) == pytest.approx(3.0)


def test_mean_pairwise_cosine_equals_the_pairwise_loop():
    x = np.random.default_rng(2).standard_normal((9, 5))
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    loop = np.mean([u[i] @ u[j] for i in range(9) for j in range(9) if i != j])
    assert mean_pairwise_cosine(x) == pytest.approx(loop)


def test_defect_stats_stream_like_one_batch():
    rng = np.random.default_rng(3)
    h, x, y = (rng.standard_normal((6, 10, 4)) for _ in range(3))
    whole, parts = DefectStats(2), DefectStats(2)
    whole.update(0, h, x, y)
    for i in range(6):
        parts.update(0, h[i], x[i], y[i])
    for key in ("c", "c_stream", "alpha"):
        assert parts.result()[key][0] == pytest.approx(whole.result()[key][0])
        assert whole.result()[key][1] is None  # never seen: not applicable, not zero
    assert whole.result()["c"][0] == pytest.approx(np.sum((h - x) ** 2) / np.sum(h**2))
    assert whole.result()["alpha"][0] == pytest.approx(np.sum(h * x) / np.sum(x**2))


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, None, 3, 4, 5], [2, 9, 1, 3, 4]) == pytest.approx(np.corrcoef([0, 1, 2, 3], [1, 0, 2, 3])[0, 1])
    assert spearman([1, 2], [1, 2]) is None


@pytest.mark.parametrize("tokens", [13, 6], ids=["d_gram", "token_gram"])
def test_in_graph_statistics_equal_the_numpy_geometry(tokens):
    """stats.py's ONNX reductions equal geometry.py / DefectStats on random block tensors, to float64 error."""
    import onnx_ir as ir

    from surgery.analysis.defect import DefectStats
    from surgery.diagnostics import stats
    from surgery.diagnostics.geometry import alignment, effective_rank, mean_pairwise_cosine
    from surgery.engine import runtime

    rng = np.random.default_rng(4)
    kinds = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "mlp_out_on_pre", "resid_post")
    arrays = {k: (rng.standard_normal((1, tokens, 8)) + (3.0 if k.startswith("resid") else 0.0)).astype(np.float32) for k in kinds}
    inputs = {k: ir.Value(name=k, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, "pos", 8])) for k in kinds}
    nodes, out = stats.layer_stats(inputs, 0, token_gram=tokens - 1 <= 8)  # the smaller Gram, as diagnose picks
    for v in out.values():
        v.dtype = ir.DataType.DOUBLE
    model = ir.Model(ir.Graph(list(inputs.values()), list(out.values()), nodes=nodes, opset_imports={"": 18}), ir_version=9)
    sess = runtime.session(model)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, arrays)))
    t = {k: v[0, 1:] for k, v in arrays.items()}
    n = len(t["resid_pre"])

    np.testing.assert_allclose(got[stats.name(0, "align")][0], alignment(t["resid_pre"], t["attn_out"], t["resid_post"]).sum(), rtol=1e-12)
    for point, key in stats.POINTS.items():
        mpc = stats.mean_pairwise_cosine(got[stats.name(0, f"sum_u.{point}")][0], n)
        np.testing.assert_allclose(mpc, mean_pairwise_cosine(t[key]), rtol=1e-10)
        np.testing.assert_allclose(stats.effective_rank(got[stats.name(0, f"gram.{point}")][0]), effective_rank(t[key]), rtol=1e-10)
    reference = DefectStats(1)
    reference.update(0, t["mlp_out"], t["mlp_out_on_pre"], t["resid_post"])
    np.testing.assert_allclose(got[stats.name(0, "defect")], reference.sums[0], rtol=1e-12)
    np.testing.assert_allclose(got[stats.name(0, "field_norm")][0], np.linalg.norm(t["resid_mid"].astype(np.float64), axis=-1), rtol=1e-12)
