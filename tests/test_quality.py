"""llama.cpp's `perplexity --kl-divergence` statistics (surgery.measure.quality) against a transcription of llama.cpp's
accumulators in NumPy on both graphs' raw logits, and its uncertainty formulas against simulation."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from surgery.cli import app
from surgery.engine import runtime
from surgery.files import graph
from surgery.measure import quality, scoring, statistics
from surgery.passes import ablate, parallelize
from surgery.text import data

runner = CliRunner()


def _llama_cpp(nll_base, nll, kld, same_top) -> dict:
    """llama.cpp's kl_divergence() report (tools/perplexity/perplexity.cpp) from per-position values: running sums,
    mean_and_uncertainty, covariance, its percentile lambda and median, Δp and Same top p in %."""
    n = len(nll)
    sums = {"nll": nll.sum(), "nll2": (nll**2).sum(), "base": nll_base.sum(), "base2": (nll_base**2).sum(), "cross": (nll * nll_base).sum()}

    def mean_unc(s, s2):
        f = s / n
        df = s2 / n - f * f
        return f, math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0

    def percentile(values, fraction):
        if fraction <= 0:
            return values[0]
        if fraction >= 1:
            return values[-1]
        p = fraction * (n - 1)
        ip = int(p)
        p -= ip
        return (1 - p) * values[ip] + p * values[min(ip + 1, n - 1)]

    median = lambda v: 0.5 * (v[n // 2] + v[n // 2 - 1]) if n % 2 == 0 else v[n // 2]
    log_ppl, log_base = mean_unc(sums["nll"], sums["nll2"]), mean_unc(sums["base"], sums["base2"])
    cov = (sums["cross"] / n - (sums["nll"] / n) * (sums["base"] / n)) / (n - 1) if n >= 10 else 0.0
    out = {"count": n, "Mean PPL(Q)": math.exp(log_ppl[0]), "Mean PPL(Q) uncertainty": math.exp(log_ppl[0]) * log_ppl[1],
           "Mean PPL(base)": math.exp(log_base[0]), "Mean PPL(base) uncertainty": math.exp(log_base[0]) * log_base[1],
           "Cor(ln(PPL(Q)), ln(PPL(base)))": 100 * cov / (log_ppl[1] * log_base[1]),
           "Mean ln(PPL(Q)/PPL(base))": log_ppl[0] - log_base[0],
           "Mean ln(PPL(Q)/PPL(base)) uncertainty": math.sqrt(log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov)}
    kl_sorted = np.sort(kld)
    out["Mean KLD"], out["Mean KLD uncertainty"] = mean_unc(kld.sum(), (kld**2).sum())
    for label, fraction in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9), ("10.0%", 0.1), ("5.0%", 0.05), ("1.0%", 0.01), ("0.1%", 0.001)):
        out[f"{label} KLD"] = percentile(kl_sorted, fraction)
    out |= {"Maximum KLD": kl_sorted[-1], "Median KLD": median(kl_sorted), "Minimum KLD": kl_sorted[0]}
    dp = np.exp(-nll) - np.exp(-nll_base)
    dp_sorted = np.sort(dp)
    mean, unc = mean_unc(dp.sum(), (dp**2).sum())
    out |= {"Mean Δp": 100 * mean, "Mean Δp uncertainty": 100 * unc, "Maximum Δp": 100 * dp_sorted[-1], "Median Δp": 100 * median(dp_sorted),
            "Minimum Δp": 100 * dp_sorted[0]}
    for label, fraction in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9), ("75.0%", 0.75), ("25.0%", 0.25),
                            ("10.0%", 0.1), ("5.0%", 0.05), ("1.0%", 0.01), ("0.1%", 0.001)):
        out[f"{label} Δp"] = 100 * percentile(dp_sorted, fraction)
    mse, mse_unc = mean_unc((dp**2).sum(), (dp**4).sum())
    out["RMS Δp"], out["RMS Δp uncertainty"] = 100 * math.sqrt(mse), 100 * 0.5 / math.sqrt(mse) * mse_unc
    top = same_top / n
    out["Same top p"], out["Same top p uncertainty"] = 100 * top, 100 * math.sqrt(top * (1 - top) / (n - 1))
    return out


def numpy_llama_cpp(first, other, windows) -> dict:
    """llama.cpp's report of `other` against `first` on the scored positions of `windows`, from each graph's raw
    `logits` (one window per run) with log-softmax in float64 NumPy. The graphs are loaded as the scorer loads them: a
    file and its loaded view differ by 2e-7 in the logits, which int4's int8 activations (accuracy_level 4) can round
    to a different code, and the statistics, not the session path, are under test."""
    sessions = [runtime.session(graph.load(m) if isinstance(m, (str, Path)) else m) for m in (first, other)]
    nll, kld, same = ([], []), [], 0
    for row, start in zip(windows.ids, windows.score_from):
        logp = []
        for sess in sessions:
            logits = sess.run(["logits"], runtime.feeds(sess, row[None]))[0][0].astype(np.float64)
            shifted = logits - logits.max(-1, keepdims=True)
            logp.append((shifted - np.log(np.exp(shifted).sum(-1, keepdims=True)))[start : len(row) - 1])
        targets = row[start + 1 :]
        for i in (0, 1):
            nll[i].extend(-logp[i][np.arange(len(targets)), targets])
        kld.extend((np.exp(logp[0]) * (logp[0] - logp[1])).sum(-1))
        same += int((logp[0].argmax(-1) == logp[1].argmax(-1)).sum())
    return _llama_cpp(np.array(nll[0]), np.array(nll[1]), np.array(kld), same)


def assert_report_equal(got: dict, expected: dict) -> None:
    assert list(got) == [k for k in _ORDER if k in got] and set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


# llama.cpp's order of printing
_ORDER = ["count", "Mean PPL(Q)", "Mean PPL(Q) uncertainty", "Mean PPL(base)", "Mean PPL(base) uncertainty", "Cor(ln(PPL(Q)), ln(PPL(base)))",
          "Mean ln(PPL(Q)/PPL(base))", "Mean ln(PPL(Q)/PPL(base)) uncertainty", "Mean KLD", "Mean KLD uncertainty"]
_ORDER += [f"{label} KLD" for label, _ in quality.KLD_ROWS] + ["Mean Δp", "Mean Δp uncertainty"] + [f"{label} Δp" for label, _ in quality.DP_ROWS]
_ORDER += ["RMS Δp", "RMS Δp uncertainty", "Same top p", "Same top p uncertainty"]


def test_llama_cpp_statistics_equal_numpy_on_the_raw_logits(fixture_path, tmp_path):
    """Every statistic of llama.cpp's report, from the scoring graphs' per-token NLL, KL_t and top-1 (batches of 2),
    equals llama.cpp's formulas on float64 NumPy log-softmax of both graphs' logits; against itself: 0 KLD, 100 %."""
    folder = fixture_path("llama")
    w = data.windows(folder, "text", seq_len=40, stride=30, max_windows=5)  # text: the loss counts every window (as llama.cpp)
    rewritten = graph.write(ablate(graph.load(folder), "attn", "scale", [0, 1], scale=3.0).model, tmp_path / "ablated", like=folder)
    base, same, other = scoring.compare([folder, folder, rewritten], w, batch_size=2)
    assert len(base.token_nll) == len(other.token_nll) == len(other.token_kl) == w.tokens > 100
    got = statistics.divergence(other, base).llama_cpp.to_json()
    expected = numpy_llama_cpp(folder, rewritten, w)
    assert expected["Mean KLD"] > 1e-4 and expected["Same top p"] < 100 and abs(expected["Mean Δp"]) > 1e-4  # the models differ
    assert_report_equal(got, expected)
    assert got["Mean KLD"] == pytest.approx(statistics.divergence(other).kl, rel=1e-9)  # beside the bootstrap's point, the same mean
    assert got["Mean ln(PPL(Q)/PPL(base))"] == pytest.approx(other.loss - base.loss, abs=1e-9)
    itself = statistics.divergence(same, base).llama_cpp
    assert abs(itself.mean_kld.value) < 1e-6 and itself.same_top_p == quality.Estimate(1.0, 0.0) and itself.rms_dp.value < 1e-6
    assert statistics.divergence(other).llama_cpp is None and "llama_cpp" not in statistics.divergence(other).to_json()


@pytest.fixture(scope="module")
def builds(tmp_path_factory, tiny_export):
    from tests.test_deployed import Builds

    return Builds(tmp_path_factory.mktemp("deployed"), tiny_export)


@pytest.mark.parametrize("name", ["genai-fp32", "genai-int4"])
def test_llama_cpp_statistics_equal_numpy_on_genai_graphs(builds, name, tmp_path):
    """The same on the GenAI builder's graphs (GroupQueryAttention; MatMulNBits in int4), original against a
    parallelized copy."""
    folder = builds.variant(name)
    rewritten = graph.write(parallelize(graph.load(folder), [0, 1]).model, tmp_path / "parallel", like=folder)
    w = data.windows(folder, seq_len=32, max_windows=4)
    base, other = scoring.compare([folder, rewritten], w)
    expected = numpy_llama_cpp(folder, rewritten, w)
    assert expected["Mean KLD"] > 1e-5 and expected["RMS Δp"] > 1e-4
    assert_report_equal(statistics.divergence(other, base).llama_cpp.to_json(), expected)


def test_uncertainties_are_llama_cpps_standard_errors():
    """mean_and_uncertainty is the standard error sqrt(population variance / (n - 1)), 0 at n <= 10 positions; it,
    the binomial one of Same top p and the delta method's of RMS Δp match the spread of their estimates over
    repeated samples."""
    x = np.array([0.5, 1.5, 2.0, 4.0, 0.0, 3.0, 1.0, 2.5, 0.5, 1.0, 6.0])
    e = quality.mean_and_uncertainty(x)
    assert e.value == pytest.approx(x.mean()) and e.uncertainty == pytest.approx(x.std() / math.sqrt(len(x) - 1), rel=1e-12)
    assert quality.mean_and_uncertainty(x[:10]).uncertainty == 0 and quality.mean_and_uncertainty(np.full(20, 0.5)).uncertainty == 0
    assert quality.proportion(3, 4) == quality.Estimate(0.75, math.sqrt(0.75 * 0.25 / 3))
    assert quality.rms(np.zeros(20)) == quality.Estimate(0.0, 0.0)
    assert quality.covariance(x, x) == pytest.approx(x.var() / (len(x) - 1)) and quality.covariance(x[:9], x[:9]) == 0
    rng, n = np.random.default_rng(0), 400
    samples = rng.exponential(0.05, size=(3000, n))  # KL_t-like: skewed, positive
    means = samples.mean(1)
    assert quality.mean_and_uncertainty(samples[0]).uncertainty == pytest.approx(means.std(), rel=0.1)
    dp = rng.normal(0.0, 0.03, size=(3000, n)) + rng.normal(0, 0.1, size=(3000, n)) ** 3
    rms = np.sqrt((dp**2).mean(1))
    assert quality.rms(dp[0]).uncertainty == pytest.approx(rms.std(), rel=0.15)
    hits = rng.random((3000, n)) < 0.85
    assert quality.proportion(int(hits[0].sum()), n).uncertainty == pytest.approx(hits.mean(1).std(), rel=0.1)


def test_percentiles_interpolate_like_llama_cpp():
    """llama.cpp's percentile: (1 - p) v[i] + p v[i + 1] at fraction * (n - 1) = i + p over the sorted values;
    Median the middle value, or the mean of the two middle ones."""
    values = np.array([5.0, 1.0, 4.0, 2.0, 3.0, 10.0])
    got = quality.percentiles(values, quality.DP_ROWS)
    assert list(got) == ["Maximum", "99.9%", "99.0%", "95.0%", "90.0%", "75.0%", "Median", "25.0%", "10.0%", "5.0%", "1.0%", "0.1%", "Minimum"]
    assert (got["Maximum"], got["Minimum"], got["Median"]) == (10.0, 1.0, 3.5)
    assert got["90.0%"] == pytest.approx(5 + 0.5 * 5) and got["25.0%"] == pytest.approx(2.25) and got["0.1%"] == pytest.approx(1.005)
    assert quality.percentiles(values[:5], quality.KLD_ROWS)["Median"] == 3.0


def test_evaluate_prints_and_writes_llama_cpp_statistics(fixture_path, tmp_path):
    src = fixture_path("llama")
    ablated = graph.write(ablate(graph.load(src), "mlp", "remove", [1]).model, tmp_path / "ablated", like=src)
    args = ["evaluate", str(src), str(ablated), "--seq-len", "32", "--max-windows", "3", "--no-latency"]
    shown, printed = runner.invoke(app, args), runner.invoke(app, [*args, "--json"])
    assert shown.exit_code == 0 and printed.exit_code == 0, shown.output + printed.output
    first, second = json.loads(printed.stdout)["models"]
    assert first["llama_cpp"] is None and list(second["llama_cpp"]) == _ORDER
    assert_report_equal(second["llama_cpp"], numpy_llama_cpp(src, ablated, data.windows(src, seq_len=32, max_windows=3)))
    stats = second["llama_cpp"]
    for cell in (f"{stats['Same top p']:.3f} ± {stats['Same top p uncertainty']:.3f} %", f"{stats['99.9% KLD']:.4f}",
                 f"{stats['RMS Δp']:.3f} ± {stats['RMS Δp uncertainty']:.3f} %", "Same top p", "99.9% KLD", "RMS Δp"):
        assert cell in shown.stdout


def test_the_main_job_prints_and_saves_llama_cpp_statistics(fixture_path, tmp_path):
    """parallelize --layers auto: the summary's llama.cpp line and selection.json's full report on the evaluation
    windows, equal to NumPy on the written graph's logits; the selection's final cost has one too."""
    src, out = fixture_path("llama"), tmp_path / "auto"
    args = ["parallelize", str(src), "-o", str(out), "--seq-len", "32", "--windows", "2", "--fit-windows", "4", "--eval-windows", "2",
            "--no-latency", "--max-kl", "none", "--max-loss-increase", "none"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "selection.json").read_text())
    stats = saved["divergence_eval"]["llama_cpp"]
    ev = data.windows(src, seq_len=32, max_windows=2, part="evaluation")
    expected = numpy_llama_cpp(src, out, ev)
    assert expected["Mean KLD"] > 1e-4
    assert_report_equal(stats, expected)
    line = f"Same top p {stats['Same top p']:.3f} ± {stats['Same top p uncertainty']:.3f} %, 99.9% KLD {stats['99.9% KLD']:.4f}, RMS Δp"
    assert line in result.stdout and "llama.cpp" in result.stdout
    selection = saved["selection"]["divergence"]
    assert list(selection["llama_cpp"]) == _ORDER and selection["llama_cpp"]["Mean KLD"] == pytest.approx(selection["kl"], rel=1e-9)
