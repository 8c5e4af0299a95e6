import subprocess
import sys

import numpy as np
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

from surgery.cli import app
from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.measure import scoring, statistics, timing
from surgery.passes import ablate
from surgery.report import numbers
from surgery.text import data

runner = CliRunner()


def _numpy_loss(model_path, windows) -> float:
    """NLL from the plain graph's logits, with log-softmax in float64 NumPy, over the text windows (not the model's samples)."""
    sess = runtime.session(model_path)
    total, count = 0.0, 0
    for row, start in zip(windows.ids[~windows.sampled], windows.score_from[~windows.sampled]):
        logits = sess.run(["logits"], runtime.feeds(sess, row[None]))[0][0].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
        for t in range(start, len(row) - 1):
            total -= logp[t, row[t + 1]]
            count += 1
    return total / count


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox_parallel"])
@pytest.mark.parametrize("stride", [None, 20])
def test_perplexity_equals_numpy_on_the_logits(fixture_path, family, stride):
    w = data.windows(fixture_path(family), seq_len=48, stride=stride, max_windows=6)
    got = scoring.perplexity(fixture_path(family), w, batch_size=4)
    assert got.tokens == w.tokens and got.windows == 6 and w.sampled.sum() == 3
    assert got.loss == pytest.approx(_numpy_loss(fixture_path(family), w), abs=1e-5)
    assert got.perplexity == pytest.approx(np.exp(got.loss))


def test_perplexity_equals_the_hf_torch_model(tiny_export):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    tiny = tiny_export("qwen2", seed=2)
    folder = tiny.onnx
    w = data.windows(folder, "text", seq_len=40, max_windows=4)
    reference = AutoModelForCausalLM.from_pretrained(tiny.hf).eval()
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(w.ids)).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), torch.from_numpy(w.ids[:, 1:]).reshape(-1))
    assert scoring.perplexity(folder, w).loss == pytest.approx(float(nll), abs=1e-4)


def _scored(window_nll, window_tokens) -> statistics.Perplexity:
    loss = float(np.sum(window_nll) / np.sum(window_tokens))
    return statistics.Perplexity(loss, float(np.exp(loss)), int(np.sum(window_tokens)), len(window_tokens), 0.0,
                               tuple(float(x) for x in window_nll), tuple(int(t) for t in window_tokens))


def test_delta_is_a_paired_bootstrap_over_windows():
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 60, size=12)
    base = _scored(rng.uniform(2, 4, size=12) * tokens, tokens)
    same = statistics.delta(base, base)
    assert (same.dnll, same.low, same.high) == (0, 0, 0)
    shifted = statistics.delta(base, _scored(np.array(base.window_nll) + 0.037 * tokens, tokens))  # +0.037 nats on every token
    for value in (shifted.dnll, shifted.low, shifted.high):
        assert value == pytest.approx(0.037, abs=1e-12)
    assert numbers.dnll(shifted) == "+0.0370 [+0.0370, +0.0370]" and shifted.to_json()["low"] == shifted.low
    with pytest.raises(SurgeryError, match="same windows"):
        statistics.delta(base, _scored(base.window_nll, tokens + 1))

    sim, true_mean, windows, per_window, covered = np.random.default_rng(1), 0.02, 20, 100, 0
    for _ in range(300):  # per-window dNLL i.i.d. N(0.02, 0.05) per token; the interval should cover 0.02 ~95 % of the time
        nll = sim.uniform(2, 4, size=windows) * per_window
        diff = sim.normal(true_mean, 0.05, size=windows) * per_window
        d = statistics.delta(_scored(nll, [per_window] * windows), _scored(nll + diff, [per_window] * windows))
        assert d.low <= d.dnll <= d.high
        covered += d.low <= true_mean <= d.high
    assert 0.88 <= covered / 300 <= 0.99


def test_the_models_own_samples_count_in_kl_not_in_the_loss(fixture_path):
    """On the default corpus the loss and dNLL are the text windows' (NumPy on them alone), KL and top-1 all windows'."""
    src, rng = fixture_path("llama"), np.random.default_rng(3)
    w = data.windows(src, seq_len=32, max_windows=8)
    other = graph.load(src)
    weight = next(v for v in other.graph.initializers.values() if v.const_value is not None and v.const_value.numpy().ndim == 2)
    weight.const_value = ir.tensor(weight.const_value.numpy() + rng.normal(0, 0.05, weight.const_value.shape).astype(np.float32))
    base, changed = scoring.compare([src, other], w)
    text = ~w.sampled
    assert text.sum() == 4 and base.text().tolist() == np.flatnonzero(text).tolist()
    assert base.loss == pytest.approx(_numpy_loss(src, w), abs=1e-5)
    nll = lambda p: np.asarray(p.window_nll)[text].sum() / np.asarray(p.window_tokens)[text].sum()  # noqa: E731
    assert statistics.delta(base, changed).dnll == pytest.approx(nll(changed) - nll(base), abs=1e-12)
    assert statistics.divergence(changed).kl == pytest.approx(sum(changed.window_kl) / sum(changed.window_tokens), abs=1e-12)
    both = statistics.joined([scoring.compare([src, other], w.take(range(k, k + 4)))[1] for k in (0, 4)])
    assert both.window_sampled == changed.window_sampled and both.loss == pytest.approx(changed.loss, abs=1e-6)
    samples_only = scoring.perplexity(src, w.take(np.flatnonzero(w.sampled)))
    assert samples_only.loss == pytest.approx(sum(samples_only.window_nll) / samples_only.tokens)  # all samples: they count


def test_decode_with_the_kv_cache_continues_the_prefill(fixture_path):
    """The decode run that latency() times sees a cache of seq_len and predicts what a full pass predicts."""
    sess = runtime.session(fixture_path("llama"))
    ids = np.random.default_rng(0).integers(0, 512, size=(2, 17))
    prefill = sess.run(None, runtime.feeds(sess, ids[:, :16]))
    past = runtime.present_as_past(sess, prefill)
    assert {v.shape[2] for v in past.values()} == {16} and len(past) == 6
    decode_feed = runtime.feeds(sess, ids[:, 16:], past)
    assert decode_feed["attention_mask"].shape == (2, 17) and (decode_feed["position_ids"] == 16).all()
    decoded = sess.run(["logits"], decode_feed)[0][:, -1]
    full = sess.run(["logits"], runtime.feeds(sess, ids))[0][:, -1]
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-5)


def test_latency_reports_every_graph(fixture_path):
    results = timing.latency([fixture_path("llama"), fixture_path("gpt2")], seq_len=32, repeats=3, warmup=1)
    assert [r.repeats for r in results] == [3, 3]
    assert all(r.decode_ms is not None and r.prefill_p90_ms >= r.prefill_ms for r in results)
    assert {r.provider for r in results} == {"CPUExecutionProvider"}


def test_evaluate_command_compares_with_the_first_model(tmp_path, fixture_path):
    src = fixture_path("llama")
    ablated = tmp_path / "ablated"
    graph.write(ablate(graph.load(src), "mlp", "remove", {0, 1, 2}).model, ablated, like=src)
    args = ["evaluate", str(src), str(ablated), "--seq-len", "32", "--max-windows", "6", "--repeats", "2", "--warmup", "1", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    first, second = report["models"]
    assert first["dnll"] == 0 and first["prefill_ratio"] == 1
    assert second["dnll"] == pytest.approx(second["loss"] - first["loss"]) and second["dnll"] != 0
    assert second["decode_ratio"] == pytest.approx(first["decode_ms"] / second["decode_ms"])
    assert first["dnll_interval"] is None
    low, high = second["dnll_interval"]
    assert low <= second["dnll"] <= high and low < high
    assert first["kl"] is None and 0 < second["kl_interval"][0] <= second["kl"] <= second["kl_interval"][1]
    windows = data.windows(src, seq_len=32, max_windows=6)
    assert second["kl"] == pytest.approx(statistics.divergence(scoring.compare([src, ablated], windows)[1]).kl)
    assert 0 <= second["top1_agreement"] < 1
    shown = runner.invoke(app, args[:-1] + ["--no-latency"])
    assert shown.exit_code == 0, shown.output
    assert "95 % CI" in shown.stdout and f"[{low:+.4f}, {high:+.4f}]" in shown.stdout
    assert f"{second['kl']:.4f}" in shown.stdout and f"{100 * second['top1_agreement']:.1f} %" in shown.stdout


def test_graph_without_logits_is_one_clear_error(tmp_path, fixture_path):
    model = graph.load(fixture_path("llama"))
    model.graph.outputs[0].name = "scores"
    graph.save(model, tmp_path / "model.onnx")
    (tmp_path / "tokenizer.json").write_bytes((fixture_path("llama") / "tokenizer.json").read_bytes())
    result = runner.invoke(app, ["evaluate", str(tmp_path), "--seq-len", "32", "--no-latency"])
    assert result.exit_code == 1 and "has no `logits` output" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seq-len", "300"], "beyond the model's position limit 256"),
        (["--seq-len", "32", "--data", "{tmp}/missing.txt"], "does not exist"),
        (["--seq-len", "32", "--data", "{tmp}/empty.txt"], "has no text"),
    ],
)
def test_evaluate_bad_input(tmp_path, fixture_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    result = runner.invoke(app, ["evaluate", str(fixture_path("llama")), *[a.format(tmp=tmp_path) for a in args]])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and message in result.stderr and "Traceback" not in result.output


def test_cpu_machine_prints_no_cuda_errors(fixture_path):
    run = subprocess.run(
        [sys.executable, "-m", "surgery.cli", "evaluate", str(fixture_path("gpt2")), "--seq-len", "32", "--max-windows", "2", "--repeats", "2"],
        capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "CUDA" not in run.stderr and "cuda" not in run.stderr.lower() and "error" not in run.stderr.lower()


def test_graph_without_kv_cache_gets_prefill_only(tiny_export):
    pytest.importorskip("torch")
    folder = tiny_export("llama", past=False, seed=0).onnx
    (result,) = timing.latency([folder], seq_len=16, repeats=2, warmup=1)
    assert result.decode_ms is None and result.decode_p90_ms is None and result.prefill_ms > 0
    shown = runner.invoke(app, ["evaluate", str(folder), "--seq-len", "16", "--max-windows", "2", "--repeats", "2", "--json"])
    assert shown.exit_code == 0, shown.output
    (row,) = __import__("json").loads(shown.stdout)["models"]
    assert row["decode_ms"] is None and row["decode_ratio"] is None and row["prefill_ratio"] == 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kl_and_top1_agreement_equal_numpy_on_the_raw_logits(fixture_path, family, tmp_path, numpy_divergence):
    """KL(first || rewritten), its p99 and top-1 agreement, computed inside the scoring graphs batch by batch,
    equal float64 NumPy on both graphs' logits; the first model against itself is 0 KL and full agreement."""
    folder = fixture_path(family)
    w = data.windows(folder, seq_len=40, stride=30, max_windows=5)
    rewritten = tmp_path / "mlp-scaled.onnx"
    graph.save(ablate(graph.load(folder), "attn", "scale", [0, 1], scale=3.0).model, rewritten)
    base, same, other = scoring.compare([folder, folder, rewritten], w)  # batch 1, as the NumPy side runs
    expected = numpy_divergence(folder, rewritten, w)
    got = statistics.divergence(other)
    assert got.kl > 1e-4 and got.low <= got.kl <= got.high
    assert got.kl == pytest.approx(expected["kl"], rel=1e-5, abs=1e-7)
    # one position's KL_t carries the float32 rounding of log-probs near -log(vocab): ~5e-7
    assert got.p99 == pytest.approx(expected["p99"], rel=1e-5, abs=1e-6)
    assert got.top1 == pytest.approx(expected["top1"])
    assert other.loss == pytest.approx(scoring.perplexity(rewritten, w).loss, abs=1e-6) and base.window_kl == ()
    itself = statistics.divergence(same)
    assert abs(itself.kl) < 1e-6 and itself.top1 == 1.0


def _logits_model(vocab: int) -> ir.Model:
    """A graph whose `logits` output is its input: the scoring graph's log-softmax fed chosen logits directly."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch_size", "sequence_length", vocab]))
    node = ir.node("Identity", [x])
    node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = "logits", ir.DataType.FLOAT, x.shape
    return ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 18}), ir_version=9)


@pytest.mark.parametrize("vocab", [49152, 50257])
def test_scoring_log_softmax_has_no_float_sum_bias(vocab):
    """The scoring graph's log-probabilities equal float64 NumPy's on peaked logits (a few likely words, as a trained
    model's; a 49152- and a 50257-word vocabulary, the second padded to blocks): mean error under 5e-7 nats, where ONNX
    Runtime's own float LogSoftmax on the same logits is over 5e-6 too high (1.8e-5 on SmolLM2's)."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((2, 64, vocab)) * 2.5 + 3).astype(np.float32)
    logits[..., :3] += 12
    sess = runtime.session(scoring.scoring_model(_logits_model(vocab)))
    ours = sess.run([scoring.LOGPROBS], {"x": logits, scoring.TARGETS: np.zeros((2, 64), np.int64)})[0].astype(np.float64)
    exact = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    exact -= np.log(np.exp(exact).sum(-1, keepdims=True))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 64, vocab]))
    node = ir.node("LogSoftmax", [x], attributes={"axis": -1})
    plain = runtime.session(ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 18}), ir_version=9))
    assert abs((ours - exact).mean()) < 5e-7 and np.abs(ours - exact).max() < 1e-5
    assert (plain.run(None, {"x": logits})[0] - exact).mean() > 5e-6  # what the blocks are for


@pytest.mark.parametrize("vocab", [49152])
def test_float_sum_log_softmax_is_torchs(vocab):
    """scoring_model(float_sum=True), what `--like hf` scores with: ORT's LogSoftmax, which on peaked logits carries the
    same bias as torch's float32 log_softmax (what lm-eval's `hf` backend takes): equal to it to 2e-6 per entry, both
    over 5e-6 above float64 on average."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((2, 64, vocab)) * 2.5 + 3).astype(np.float32)
    logits[..., :3] += 12
    sess = runtime.session(scoring.scoring_model(_logits_model(vocab), float_sum=True))
    ours = sess.run([scoring.LOGPROBS], {"x": logits, scoring.TARGETS: np.zeros((2, 64), np.int64)})[0].astype(np.float64)
    theirs = torch.log_softmax(torch.from_numpy(logits), -1).double().numpy()
    exact = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    exact -= np.log(np.exp(exact).sum(-1, keepdims=True))
    assert np.abs(ours - theirs).max() < 2e-6
    assert (ours - exact).mean() > 5e-6 and (theirs - exact).mean() > 5e-6


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_selected_positions_score_what_every_position_scores(fixture_path, family):
    """scoring_model(select=True) scores only the flat positions it is given (the vocabulary projection reads those rows
    of its hidden states): the same NLL and top-1 as the whole graph's at those positions, on a graph with a KV cache."""
    model = graph.load(fixture_path(family))
    selected = scoring.scoring_model(model, select=True)
    every, chosen = runtime.session(scoring.scoring_model(model)), runtime.session(selected)
    head = next(n for n in selected.graph if any(v.name == "logits" for v in n.outputs))
    assert head.op_type == "MatMul" and head.inputs[0].producer().name.startswith("surgery/select/")  # rows picked before it
    ids = np.random.default_rng(1).integers(0, 100, (3, 9))
    targets = np.roll(ids, -1, axis=1)
    nll, top1 = every.run([scoring.NLL, scoring.TOP1], runtime.feeds(every, ids, extra={scoring.TARGETS: targets}))
    positions = np.array([0, 5, 8, 9 + 2, 2 * 9 + 7])
    got = chosen.run([scoring.NLL, scoring.TOP1], runtime.feeds(chosen, ids, extra={scoring.TARGETS: targets.reshape(-1)[positions][None],
                                                                                     scoring.POSITIONS: positions}))
    np.testing.assert_allclose(got[0][0], nll.reshape(-1)[positions], rtol=1e-5, atol=1e-6)
    assert (got[1][0] == top1.reshape(-1)[positions]).all()
