import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from surgery import compensation
from surgery.analysis import field as field_graph
from surgery.analysis import probe as probe_graph
from surgery.analysis import resumable as resumable_graph
from surgery.cli import app
from surgery.diagnostics import SECTIONS, DiagnoseSettings, diagnose, prefix
from surgery.diagnostics.diagnose import PARALLEL, ablation_kind, switch_losses
from surgery.diagnostics.rank import spearman
from surgery.engine import runtime
from surgery.files import graph
from surgery.measure import scoring, statistics
from surgery.model.blocks import find_blocks
from surgery.passes import ablate, compensate, parallelize
from surgery.text import data
from surgery.text.data import DataSettings

runner = CliRunner()


def _tapped_run(model, ids):
    p = probe_graph.probe(model, twin=False)
    sess = runtime.session(p.model)
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, runtime.feeds(sess, ids))))
    return [{k: out[v][0, 1:].astype(np.float64) for k, v in o.items()} for o in p.outputs]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_pass_defect_equals_two_separate_passes(fixture_path, family):
    path = fixture_path(family)
    report = diagnose(path, DiagnoseSettings(DataSettings(seq_len=40), windows=3, only=("defect", "gate"), eval_windows=2))
    model = graph.load(path)
    windows = data.windows(path, seq_len=40, max_windows=3, part="calibration")
    sums = np.zeros((3, 5))
    for i in range(len(windows)):
        ids = windows.ids[i : i + 1]
        original = _tapped_run(model, ids)
        for layer in range(3):
            on_x = _tapped_run(parallelize(model, {layer}).model, ids)[layer]["mlp_out"]  # same x, mlp reads it
            h, y = original[layer]["mlp_out"], original[layer]["resid_post"]
            sums[layer] += [np.sum((h - on_x) ** 2), np.sum(h**2), np.sum(y**2), np.sum(h * on_x), np.sum(on_x**2)]
    np.testing.assert_allclose(report.defect["c"], sums[:, 0] / sums[:, 1], rtol=1e-4)
    np.testing.assert_allclose(report.defect["c_stream"], sums[:, 0] / sums[:, 2], rtol=1e-4)
    np.testing.assert_allclose(report.gate["alpha"], sums[:, 3] / sums[:, 4], rtol=1e-4)


def test_geometry_equals_loops_over_the_hooked_torch_model(tiny_export):
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from tests.reference import block_tensors

    tiny = tiny_export("gpt2", seed=7)
    folder = tiny.onnx
    report = diagnose(folder, DiagnoseSettings(DataSettings(seq_len=24), windows=2, only=("deficit", "diversity")))
    reference = AutoModelForCausalLM.from_pretrained(tiny.hf, attn_implementation="eager").eval()
    windows = data.windows(folder, seq_len=24, max_windows=2, part="calibration")
    cosines = [[] for _ in range(3)]
    div = {k: [[] for _ in range(3)] for k in ("resid_pre", "resid_mid", "resid_post")}
    rank = {k: [[] for _ in range(3)] for k in div}
    for row in windows.ids:
        _, blocks = block_tensors(reference, row[None])
        for layer, t in enumerate(blocks):
            x, a, y = (t[k][0, 1:].astype(np.float64) for k in ("resid_pre", "attn_out", "resid_post"))
            for xi, ai, di in zip(x, a, y - x):  # one token at a time, projections written out
                u = xi / np.linalg.norm(xi)
                pa, pd = ai - (ai @ u) * u, di - (di @ u) * u
                cosines[layer].append(pa @ pd / np.linalg.norm(pa) / np.linalg.norm(pd))
            for key in div:
                v = t[key][0, 1:].astype(np.float64)
                v = v / np.linalg.norm(v, axis=1, keepdims=True)
                n = len(v)
                div[key][layer].append(1 - sum(v[i] @ v[j] for i in range(n) for j in range(n) if i != j) / (n * (n - 1)))
                s = np.linalg.svd(v, compute_uv=False)
                rank[key][layer].append(np.exp(-np.sum(s / s.sum() * np.log(s / s.sum()))))
    np.testing.assert_allclose(report.deficit["alignment"], [np.mean(c) for c in cosines], atol=2e-4)
    for point, key in (("pre", "resid_pre"), ("mid", "resid_mid"), ("post", "resid_post")):
        np.testing.assert_allclose(report.diversity[point]["diversity"], [np.mean(d) for d in div[key]], atol=2e-4)
        np.testing.assert_allclose(report.diversity[point]["effective_rank"], [np.mean(r) for r in rank[key]], rtol=1e-4)


def test_switchboard_losses_equal_separately_rewritten_graphs(fixture_path):
    path = fixture_path("llama")
    report = diagnose(path, DiagnoseSettings(DataSettings(seq_len=32), windows=2, eval_windows=4, only=("defect", "ablation")))  # 2 text, 2 sampled
    model = graph.load(path)
    # the compensated single-layer runs: each block with the fix fitted on the calibration windows, alone
    fits = compensation.fit(model, data.windows(path, seq_len=32, max_windows=2, part="calibration"))
    assert report.defect["c_comp"] == pytest.approx([fits[layer].c_comp for layer in range(3)], rel=1e-6)
    assert report.defect["c_comp_note"] == {}
    windows = data.windows(path, seq_len=32, max_windows=4, part="evaluation")
    base = scoring.perplexity(model, windows).loss
    assert report.ablation["base_loss"] == report.defect["base_loss"] == pytest.approx(base, abs=1e-6)
    def kl(rewritten):  # mean token KL and top-1 agreement of a written graph vs the original, scored on its own
        d = statistics.divergence(scoring.compare([model, rewritten], windows)[1])
        return pytest.approx(d.kl, rel=1e-4, abs=1e-7), pytest.approx(d.top1)

    for layer in range(3):
        expected = scoring.perplexity(parallelize(model, {layer}).model, windows).loss - base
        assert report.defect["dnll_parallel"][layer] == pytest.approx(expected, abs=1e-5)
        assert (report.defect["kl_parallel"][layer], report.defect["top1_parallel"][layer]) == kl(parallelize(model, {layer}).model)
        fixed = compensate(model, {layer: fits[layer].fix}).model
        expected = scoring.perplexity(fixed, windows).loss - base
        assert report.defect["dnll_compensated"][layer] == pytest.approx(expected, abs=1e-5)
        assert (report.defect["kl_compensated"][layer], report.defect["top1_compensated"][layer]) == kl(fixed)
        for branch in ("mlp", "attn"):
            got = report.ablation["per_layer"][branch]["radial"][layer]
            expected = scoring.perplexity(ablate(model, branch, "radial", {layer}).model, windows).loss - base
            assert got == pytest.approx(expected, abs=1e-5)
            got = report.ablation["per_layer_kl"][branch]["radial"][layer], report.ablation["per_layer_top1"][branch]["radial"][layer]
            assert got == kl(ablate(model, branch, "radial", {layer}).model)
    expected = scoring.perplexity(ablate(model, "mlp", "tangential", {0, 1, 2}).model, windows).loss - base
    assert report.ablation["all_layers"]["mlp"]["tangential"] == pytest.approx(expected, abs=1e-5)
    assert report.ablation["all_layers_kl"]["mlp"]["tangential"] == kl(ablate(model, "mlp", "tangential", {0, 1, 2}).model)[0]
    d = report.defect
    for measure, runs in (("spearman", "dnll"), ("spearman_kl", "kl")):  # C_l and C_l^stream against plain runs, C_l^comp compensated ones
        assert d[measure] == {"c": spearman(d["c"], d[f"{runs}_parallel"]), "c_stream": spearman(d["c_stream"], d[f"{runs}_parallel"]),
                              "c_comp": spearman(d["c_comp"], d[f"{runs}_compensated"])}
    assert d["kl_compensated"] != d["kl_parallel"]  # the fix changed something
    for branch, mode in (("mlp", "tangential"), ("attn", "radial")):  # the sink-kept column: position 0 keeps its output
        kept = scoring.perplexity(ablate(model, branch, mode, {0, 1, 2}, keep_sink=True).model, windows).loss - base
        assert report.ablation["all_layers_keep_sink"][branch][mode] == pytest.approx(kept, abs=1e-5)

    # each dNLL has its 95 % paired bootstrap interval beside it, the one delta() gives for separately scored graphs
    modes = ("tangential", "radial", "remove")
    pairs = list(zip(report.defect["dnll_parallel"], report.defect["dnll_parallel_interval"]))
    for b in ("mlp", "attn"):
        for m in modes:
            pairs += zip(report.ablation["per_layer"][b][m], report.ablation["per_layer_interval"][b][m])
            pairs.append((report.ablation["all_layers"][b][m], report.ablation["all_layers_interval"][b][m]))
    pairs += zip(report.defect["dnll_compensated"], report.defect["dnll_compensated_interval"])
    assert len(pairs) == 6 + 2 * 3 * 4
    for dnll, (low, high) in pairs:
        assert low - 1e-12 <= dnll <= high + 1e-12 and low < high
    scored = scoring.perplexity(model, windows)
    for got, rewritten in [(report.defect["dnll_parallel_interval"][1], parallelize(model, {1}).model),
                           (report.ablation["per_layer_interval"]["attn"]["radial"][1], ablate(model, "attn", "radial", {1}).model),
                           (report.ablation["all_layers_interval"]["mlp"]["tangential"], ablate(model, "mlp", "tangential", {0, 1, 2}).model)]:
        d = statistics.delta(scored, scoring.perplexity(rewritten, windows))
        assert got == pytest.approx([d.low, d.high], abs=1e-5)


def _losses(result: dict, kinds) -> np.ndarray:
    """Every loss of a switch_losses result, base + dNLL, interval ends included, in one order."""
    dnll = [result[kind][layer] for kind in kinds for layer in result[kind]]
    dnll += [end for kind in kinds for layer in result[kind] for end in result["interval"][kind][layer]]
    return result["base"] + np.array([0.0] + dnll)


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # optimum exports, llama's with a KV cache input
def test_losses_resumed_after_unchanged_blocks_equal_whole_forward_passes(fixture_path, family, monkeypatch):
    path = fixture_path(family)
    model = graph.load(path)
    blocks = find_blocks(model)
    kinds = [PARALLEL, ablation_kind("mlp", "radial"), ablation_kind("attn", "remove"), ablation_kind("attn", "tangential", keep_sink=True)]
    windows = data.windows(path, seq_len=32, max_windows=2, part="evaluation")

    def losses():
        return switch_losses(model, blocks, kinds, windows, runtime.Options(), lambda *_: None, all_only={kinds[-1]})

    resumed = losses()
    monkeypatch.setattr(resumable_graph, "resumable", lambda board, blocks: None)  # no block skippable: every run a whole forward
    whole = losses()
    assert set(whole[ablation_kind("mlp", "radial")]) == {0, 1, 2, "all"}  # the first and the last block's edits among them
    np.testing.assert_allclose(_losses(resumed, kinds), _losses(whole, kinds), rtol=1e-6)


def test_resumed_run_reads_only_the_given_resid_pre(fixture_path):
    path = fixture_path("llama")
    model = graph.load(path)
    blocks = find_blocks(model)
    resume = resumable_graph.resumable(model, blocks)
    assert [n.op_type for n in resume.model.graph].count("If") == 2  # every block but the last can be skipped
    scorer = scoring.Scorer(resume.model, keep=resume.resid_post)
    windows = data.windows(path, seq_len=32, max_windows=1, part="evaluation")
    kept = {}
    base = scorer(windows, extra=resume.inputs(0, {}), kept=kept)
    assert base.loss == pytest.approx(scoring.perplexity(model, windows).loss, rel=1e-6)
    for start in (1, 2):
        assert scorer(windows, extra=resume.inputs(start, kept)).loss == pytest.approx(base.loss, rel=1e-6)
        moved = {name: 2 * value for name, value in kept.items()}
        assert abs(scorer(windows, extra=resume.inputs(start, moved)).loss - base.loss) > 1e-3


def test_parallel_blocks_report_defect_as_not_applicable(fixture_path):
    report = diagnose(fixture_path("gpt_neox_parallel"), DiagnoseSettings(DataSettings(seq_len=32), windows=1, eval_windows=1, only=("defect", "gate", "diversity")))
    assert report.defect["c"] == [None] * 3 and report.defect["c_stream"] == [None] * 3
    assert report.defect["dnll_parallel"] == [None] * 3 and report.gate["alpha"] == [None] * 3
    assert report.defect["dnll_parallel_interval"] == [None] * 3
    assert report.diversity["d_attn"] == [None] * 3 and all(v is not None for v in report.diversity["d_block"])
    sections = [key for key in report.to_json() if key in SECTIONS]  # the sections that ran, in report.json's order
    assert report.deficit is None and sections == ["diversity", "defect", "gate"]


def test_field_graph_is_the_torch_mlp_of_ln2(tiny_export):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    tiny = tiny_export("llama", seed=4)
    model = graph.load(tiny.onnx)
    reference = AutoModelForCausalLM.from_pretrained(tiny.hf).eval()
    z = np.random.default_rng(0).standard_normal((1, 5, 64)).astype(np.float32)
    for block in find_blocks(model):
        sess = runtime.session(field_graph.field(model, block))
        layer = reference.model.layers[block.layer]
        with torch.no_grad():
            expected = layer.mlp(layer.post_attention_layernorm(torch.from_numpy(z))).numpy()
        np.testing.assert_allclose(sess.run(None, {field_graph.FIELD_IN: z})[0], expected, rtol=1e-4, atol=1e-5)


def test_prefix_sensitivity_matches_direct_runs(fixture_path):
    path = fixture_path("gpt2")
    model = graph.load(path)
    p = probe_graph.probe(model, tensors=("resid_post",), twin=False)
    sess = runtime.session(p.model)
    names = [o["resid_post"] for o in p.outputs]
    ids = data.windows(path, seq_len=20, max_windows=1).ids
    got = prefix.sensitivity(sess, names, ids, [1, 4], 512, np.random.default_rng(3))
    rng, t = np.random.default_rng(3), 19
    plain = sess.run(names, runtime.feeds(sess, ids))
    for k, d in enumerate([1, 4]):
        changed = ids.copy()
        changed[0, t - d] = (ids[0, t - d] + rng.integers(1, 512)) % 512
        other = sess.run(names, runtime.feeds(sess, changed))
        for layer in range(3):
            y, y2 = plain[layer][0, t], other[layer][0, t]
            assert got[layer, k] == pytest.approx(np.linalg.norm(y2 - y) / np.linalg.norm(y), rel=1e-5)
    assert prefix.distances(256) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_diagnose_command_writes_a_report_people_can_open(tmp_path, fixture_path):
    jsonschema = pytest.importorskip("jsonschema")
    from surgery.report.diagnosis import SCHEMA

    out = tmp_path / "report"
    args = ["diagnose", str(fixture_path("llama")), "-o", str(out), "--seq-len", "32", "--windows", "2", "--eval-windows", "2", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["n_layers"] == 3 and set(summary["ablation_all_layers"]) == {"mlp", "attn"}
    report = json.loads((out / "report.json").read_text())
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    page = (out / "report.html").read_text()
    images = re.findall(r"<img src='([^']+)'", page)
    assert len(images) == 6
    assert all((out / name).is_file() and (out / name).stat().st_size > 1000 for name in images)
    assert "](deficit.png)" in (out / "report.md").read_text()
    assert set(summary["ablation_all_layers_interval"]) == {"mlp", "attn"}
    md = (out / "report.md").read_text()
    low, high = report["ablation"]["all_layers_interval"]["mlp"]["remove"]
    assert f"{report['ablation']['all_layers']['mlp']['remove']:+.4f} [{low:+.4f}, {high:+.4f}]" in md
    low, high = report["defect"]["dnll_parallel_interval"][0]
    assert f"| {report['defect']['dnll_parallel'][0]:+.4f} [{low:+.4f}, {high:+.4f}] |" in md
    shown = runner.invoke(app, args[:-1])
    assert shown.exit_code == 0, shown.output
    assert re.search(r"remove [+-]\d\.\d{4} \[[+-]\d\.\d{4}, [+-]\d\.\d{4}\]", shown.stdout)


def test_diagnose_rejects_unknown_sections(tmp_path, fixture_path):
    result = runner.invoke(app, ["diagnose", str(fixture_path("llama")), "-o", str(tmp_path / "r"), "--only", "deficit,vibes"])
    assert result.exit_code == 1 and "unknown diagnostic vibes" in result.stderr
    assert not (tmp_path / "r").exists()
