"""The compensation fit (NumPy reference): normal equations, ridge choice, gate, guards; the fit graph and its passes."""

import numpy as np
import pytest

from surgery import compensation
from surgery.analysis import fit_graph
from surgery.compensation import memory
from surgery.compensation.equations import RIDGES, NormalEquations
from surgery.compensation.fitting import FitSettings
from surgery.files import graph
from surgery.model.embedding import embedding_table
from surgery.text import data


def planted(d=6, n=400, seed=0, noise=0.0):
    rng = np.random.default_rng(seed)
    a, p = rng.standard_normal((n, d)), rng.standard_normal((n, d)) * 3
    w_a, w_p, b = rng.standard_normal((d, d)), rng.standard_normal((d, d)), rng.standard_normal(d)
    delta = a @ w_a + p @ w_p + b + noise * rng.standard_normal((n, d))
    y = rng.standard_normal((n, d)) * 10
    return a, p, delta, y, (w_a, w_p, b)


def accumulate(a, p, delta, y, chunk=50):
    eq = NormalEquations(a.shape[1])
    for i, lo in enumerate(range(0, len(a), chunk)):
        s = slice(lo, lo + chunk)
        eq.update(i % 2, a[s], p[s], delta[s], y[s])
    return eq


def test_the_fit_recovers_a_planted_linear_defect():
    a, p, delta, y, (w_a, w_p, b) = planted()
    fit = accumulate(a, p, delta, y).solve(0)
    assert fit.ridge == min(RIDGES)  # exact data: the least ridge leaves the least held-out energy
    for got, want in ((fit.fix.w_a, w_a), (fit.fix.w_p, w_p), (fit.fix.b, b)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert fit.residual < 1e-10 and fit.tokens == len(a)


def test_held_out_residual_and_scores_equal_direct_numpy():
    a, p, delta, y, _ = planted(noise=2.0, n=300)
    eq = accumulate(a, p, delta, y)
    fit = eq.solve(0)
    folds = (np.arange(len(a)) // 50) % 2
    z = np.concatenate([a, p, np.ones((len(a), 1))], axis=1)
    z0, d0, z1, d1 = z[folds == 0], delta[folds == 0], z[folds == 1], delta[folds == 1]
    g = z0.T @ z0
    w = np.linalg.solve(g + fit.ridge * np.diag(np.diag(g)), z0.T @ d0)  # the ridge it chose, on fold 0
    left = np.sum((d1 - z1 @ w) ** 2)
    assert fit.residual == pytest.approx(left / np.sum(d1**2), rel=1e-8)
    assert fit.c_comp == pytest.approx(left / np.sum(y[folds == 1] ** 2), rel=1e-8)
    for r in RIDGES:  # and no other ridge does better on fold 1
        wr = np.linalg.solve(g + r * np.diag(np.diag(g)), z0.T @ d0)
        assert np.sum((d1 - z1 @ wr) ** 2) >= left * (1 - 1e-9)
    h = p + delta
    assert fit.scores["c"] == pytest.approx(np.sum(delta**2) / np.sum(h**2), rel=1e-10)
    assert fit.scores["c_stream"] == pytest.approx(np.sum(delta**2) / np.sum(y**2), rel=1e-10)
    assert fit.scores["alpha"] == pytest.approx(np.sum(h * p) / np.sum(p**2), rel=1e-10)
    gate = eq.solve(0, kind="gate")
    assert gate.fix.w_p == pytest.approx(fit.scores["alpha"] - 1) and gate.fix.w_a is None


def test_ill_conditioned_or_broken_layers_never_give_non_finite_weights():
    a, p, delta, y, _ = planted()
    a[:] = 0.0  # attention output identically zero: a singular Gram matrix
    p[:, 1] = p[:, 0]  # and two equal features
    fit = accumulate(a, p, delta, y).solve(0)
    assert fit.fix is not None and all(np.isfinite(w).all() for w in (fit.fix.w_a, fit.fix.w_p, fit.fix.b))
    bad = delta.copy()
    bad[3, 2] = np.inf
    broken = accumulate(a, p, bad, y).solve(4)
    assert broken.fix is None and "non-finite" in broken.note and broken.layer == 4
    one_fold = NormalEquations(6)
    one_fold.update(0, a, p, delta, y)
    assert one_fold.solve(0).fix is None


def test_fit_on_a_graph_lowers_the_held_out_defect(fixture_path):
    """Through ONNX Runtime on the tiny llama: the fitted fix leaves less defect on held-out windows (the output side
    alone; the input side's own held-out residual below 1 too)."""
    path = fixture_path("llama")
    model = graph.load(path)
    windows = data.windows(path, seq_len=32, max_windows=24, part="calibration")
    assert all(0 < f.input_residual < 1 and f.fix.fixes_input for f in compensation.fit(model, windows).values())
    fits = compensation.fit(model, windows, settings=FitSettings(input_fix=False))
    assert sorted(fits) == [0, 1, 2]
    for f in fits.values():
        assert f.fix is not None and 0 < f.residual < 1 and f.c_comp < f.c_stream


def test_the_fit_makes_as_many_passes_as_the_memory_bound_needs_and_says_so(fixture_path):
    path = fixture_path("llama")
    model = graph.load(path)
    windows = data.windows(path, seq_len=16, max_windows=4, part="calibration")
    one_layer = NormalEquations.nbytes(embedding_table(model)[1])
    outputs_only = FitSettings(input_fix=False)
    assert compensation.fit_passes(model, settings=outputs_only) == 1 and compensation.fit_passes(model, {0, 2}, outputs_only) == 1
    assert compensation.fit_passes(model) == 2 and compensation.fit_passes(model, settings=FitSettings(kind="gate")) == 1  # the input side's pass first
    assert compensation.fit_passes(model, settings=FitSettings(memory=one_layer)) == 6
    assert compensation.fit_passes(model, settings=FitSettings(memory=2 * one_layer, input_fix=False)) == 2
    steps = []
    chunked = compensation.fit(model, windows, settings=FitSettings(memory=one_layer), progress=lambda done, total: steps.append(total))
    assert set(steps) == {6 * len(windows)} and len(steps) == 6 * len(windows)  # two passes over the windows per layer
    whole = compensation.fit(model, windows)
    for layer, f in whole.items():  # the same sums, whichever chunk a layer is in
        for part in ("w_a", "w_p", "b", "w_in", "b_in"):  # ORT fuses the graphs of one and of three blocks differently:
            want = getattr(f.fix, part)  # float32 activations a few ulps apart
            np.testing.assert_allclose(getattr(chunked[layer].fix, part), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert chunked[layer].ridge == f.ridge


def test_a_pass_runs_only_its_own_blocks(fixture_path):
    """The pass of block 1 starts from the stream handed on by the pass of block 0 and stops after block 1: it has
    a third of the whole fit graph's MatMuls; its taps equal the whole graph's."""
    from surgery.analysis.switchboard import SWITCHES
    from surgery.engine import runtime

    model = graph.load(fixture_path("llama"))
    whole = fit_graph.fit_graph(model)
    first = fit_graph.fit_graph(model, layers=[0], hand_on=1)
    middle = fit_graph.fit_graph(model, layers=[1], resume=1, hand_on=2)
    matmuls = lambda m: sum(n.op_type == "MatMul" for n in m.graph.all_nodes())  # noqa: E731
    assert fit_graph.RESUME in {v.name for v in middle.graph.inputs}
    assert (matmuls(whole), matmuls(middle)) == (3 * 12 + 1, 12 + 1)  # a block's 12 (7 projections, 2 attention, the twin mlp's 3), the rotary angles' 1
    ids = data.windows(fixture_path("llama"), seq_len=16, max_windows=1, part="calibration").ids
    run = lambda m, extra: (s := runtime.session(m)).run(None, runtime.feeds(s, ids, extra={SWITCHES: fit_graph.switched(3), **extra}))  # noqa: E731
    names = lambda m: [v.name for v in m.graph.outputs]  # noqa: E731
    full = dict(zip(names(whole), run(whole, {})))
    stream = dict(zip(names(first), run(first, {})))[fit_graph.STREAM]
    for name, value in zip(names(middle), run(middle, {fit_graph.RESUME: stream})):
        if name != fit_graph.STREAM:
            np.testing.assert_array_equal(value, full[name], err_msg=name)


def test_fit_memory_auto_is_a_quarter_of_the_available_memory(monkeypatch, tmp_path):
    """auto reads Linux's MemAvailable (free memory and the page cache it can drop), not the free pages alone."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(meminfo if path == "/proc/meminfo" else path, *a, **k))
    assert memory.available_memory() == 20000000 * 1024
    assert memory.memory_bound("auto") == memory.memory_bound(None) == int(0.25 * 20000000 * 1024)
    monkeypatch.setattr(memory, "available_memory", lambda: 100 << 20)
    assert memory.memory_bound("auto") == 256 << 20  # at least 256 MiB
    monkeypatch.setattr(memory, "available_memory", lambda: None)
    assert memory.memory_bound("auto") == memory.MEMORY_BYTES
    assert memory.memory_bound("1.5G") == int(1.5 * (1 << 30)) and memory.memory_bound("512M") == 512 << 20


def _numpy_ridge_fit(z: np.ndarray, target: np.ndarray, folds: np.ndarray):
    """The ridge least squares target ~ z W as the fit defines it, in NumPy: the ridge (times diag(Z'Z)) whose fold-0
    fit leaves the least energy on fold 1, that held-out fraction, and the fit on both folds with it."""
    z0, t0, z1, t1 = z[folds == 0], target[folds == 0], z[folds == 1], target[folds == 1]
    g0, full = z0.T @ z0, z.T @ z
    left = {r: np.sum((t1 - z1 @ np.linalg.solve(g0 + r * np.diag(np.diag(g0)), z0.T @ t0)) ** 2) for r in RIDGES}
    ridge = min(left, key=left.get)
    return ridge, left[ridge] / np.sum(t1**2), np.linalg.solve(full + ridge * np.diag(np.diag(full)), z.T @ target)


@pytest.mark.parametrize("family, input_windows", [("llama", None), ("gpt2", None), ("llama", 5)],
                         ids=["llama", "gpt2", "llama-input-side-on-5-of-12-windows"])
def test_input_side_and_the_output_side_after_it_equal_numpy_on_the_hooked_hf_model(tiny_export, family, input_windows):
    """The input side: ln2(resid_mid) - u ~ [u, 1] W_in with u = ln2(resid_pre); then the output side on the
    input-fixed mlp, mlp(ln2(resid_mid)) - P' ~ [A, P', 1] W with P' = mlp(u (I + w_in) + b_in): both equal a NumPy
    ridge fit of the HF model's own activations (forward hooks), the ridge chosen on the held-out fold in NumPy too.
    With input_windows 5 the input side is fitted on windows 0, 3, 6, 8, 11 of the 12 (evenly spaced, folds
    alternating among them), the output side on all 12."""
    torch = pytest.importorskip("torch")
    from tests.helpers import Exported
    from tests.reference import LAYOUT

    tiny = Exported(tiny_export(family, seed=5))
    windows = data.windows(tiny.folder, seq_len=32, max_windows=12, part="calibration")
    fits = compensation.fit(tiny.onnx, windows, settings=FitSettings(input_windows=input_windows))
    inputs_rows = [0, 3, 6, 8, 11] if input_windows else list(range(12))
    blocks_path, attn_name, mlp_name, ln2_name = LAYOUT[tiny.torch.config.model_type]
    layers = tiny.torch.get_submodule(blocks_path)
    seen: dict[int, list] = {l: [] for l in range(len(layers))}
    handles = []
    for layer, block in enumerate(layers):
        state = {}
        handles.append(block.register_forward_pre_hook(lambda m, args, kwargs, state=state: state.update(pre=args[0] if args else kwargs["hidden_states"]), with_kwargs=True))

        def after_attn(module, args, output, block=block, layer=layer, state=state):
            a = output[0] if isinstance(output, tuple) else output
            ln2, mlp = block.get_submodule(ln2_name), block.get_submodule(mlp_name)
            u, v = ln2(state["pre"]), ln2(state["pre"] + a)
            fix = fits[layer].fix
            fixed = u + u @ torch.as_tensor(fix.w_in, dtype=u.dtype) + torch.as_tensor(fix.b_in, dtype=u.dtype)
            seen[layer].append([t[0, 1:].double().numpy() for t in (u, v, a, mlp(fixed), mlp(v))])

        handles.append(block.get_submodule(attn_name).register_forward_hook(after_attn))
    with torch.no_grad():
        for i in range(len(windows)):
            tiny.torch(input_ids=torch.from_numpy(windows.ids[i : i + 1]), use_cache=False)
    for h in handles:
        h.remove()
    for layer, rows in seen.items():  # predictions compared, not weights: in near-degenerate directions two ridges differ
        u, v, a, p, m = (np.concatenate([r[k] for r in rows]) for k in range(5))
        folds = np.concatenate([np.full(len(r[0]), i % 2) for i, r in enumerate(rows)])
        f, ones = fits[layer], np.ones((len(u), 1))
        on = np.concatenate([np.full(len(r[0]), i in inputs_rows) for i, r in enumerate(rows)])
        z = np.concatenate([u, ones], axis=1)
        input_folds = np.concatenate([np.full(len(rows[i][0]), j % 2) for j, i in enumerate(inputs_rows)])
        _, residual, w = _numpy_ridge_fit(z[on], (v - u)[on], input_folds)
        scale = np.abs(v - u).max()
        np.testing.assert_allclose(z @ np.concatenate([f.fix.w_in, f.fix.b_in[None]]), z @ w, rtol=0, atol=1e-3 * scale)
        assert f.input_residual == pytest.approx(residual, rel=1e-2, abs=1e-6) and f.input_residual < 1
        z = np.concatenate([a, p, ones], axis=1)
        _, residual, w = _numpy_ridge_fit(z, m - p, folds)
        got = z @ np.concatenate([f.fix.w_a, f.fix.w_p, f.fix.b[None]])
        np.testing.assert_allclose(got, z @ w, rtol=0, atol=1e-3 * np.abs(m - p).max())
        assert f.residual == pytest.approx(residual, rel=1e-2)
