import dataclasses
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from surgery.cli import app
from surgery.compensation.fitting import FitSettings
from surgery.diagnostics import DiagnoseSettings
from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.jobs.greedy import forms_to_try
from surgery.jobs.job import parallel_form
from surgery.jobs.select import Budget, SelectionSettings, select_layers
from surgery.measure import scoring, statistics
from surgery.measure.timing import LatencySettings
from surgery.model.blocks import find_blocks
from surgery.passes import Fix, ablate, fuse, parallelize
from surgery.text import data
from surgery.text.data import DataSettings
from tests.helpers import said

runner = CliRunner()


def logits(model, ids):
    sess = runtime.session(model)
    return sess.run(["logits"], runtime.feeds(sess, ids))[0]


def test_greedy_selection_keeps_only_what_fits(fixture_path):
    path = fixture_path("llama")
    model = graph.load(path)
    windows = data.windows(path, seq_len=32, max_windows=3, part="calibration")
    everything = select_layers(model, windows, fit=None, settings=SelectionSettings(Budget(None, 10.0)))
    assert everything.layers == (0, 1, 2) and everything.forward_passes == 1 + 3
    scores = [everything.c_stream[t.layer] for t in everything.trials]
    assert scores == sorted(scores)  # lowest defect first
    # The reported dNLL is the loss of the plain parallel graph of the chosen set, measured independently.
    base = scoring.perplexity(model, windows).loss
    assert everything.dnll.dnll == pytest.approx(scoring.perplexity(parallelize(model, everything.layers).model, windows).loss - base, abs=1e-5)
    assert everything.dnll.low <= everything.dnll.dnll <= everything.dnll.high

    nothing = select_layers(model, windows, fit=None, settings=SelectionSettings(Budget(1e-9, None)))
    assert nothing.layers == () and not any(t.kept for t in nothing.trials) and len(nothing.trials) == 3
    capped = select_layers(model, windows, fit=None, settings=SelectionSettings(Budget(None, 10.0), max_layers=1))
    assert len(capped.layers) == 1 and capped.layers[0] == everything.trials[0].layer
    protected = select_layers(model, windows, fit=None, settings=SelectionSettings(Budget(None, 10.0), protect_first=1, protect_last=1))
    assert protected.layers == (1,)


def test_resumed_trials_equal_the_written_graphs_scored_whole(fixture_path):
    """A trial that adds block l starts at block l from the accepted set's stream; its KL, top-1 and dNLL are those
    of the written graph of the whole set, scored from block 0, whatever was accepted before it."""
    from surgery import compensation
    from surgery.engine import cluster
    from surgery.jobs.trials import Trials

    path = fixture_path("llama")
    model = graph.load(path)
    fit_windows, windows = data.deal(data.windows(path, seq_len=32, max_windows=10, part="calibration"), [4, 6], ["fit", "selection"])
    fixes = {l: f.fix for l, f in compensation.fit(model, fit_windows).items()}
    runs = Trials(model, fixes, windows, [2, 0, 1], cluster.Pool(), runtime.Options())
    assert runs.resume is not None and runs.stops == (1, 2) and len(runs.batches) == 2
    accepted: dict[int, str] = {}
    for layer, form in ((0, "compensated"), (2, "plain"), (1, "compensated")):  # the later ones start after an accepted change
        forms = {**accepted, layer: form}
        d, kl, run = runs.loss(forms, new=layer)
        assert run["start"] == layer
        written = parallel_form(model, forms, fixes={l: fixes[l] for l, f in forms.items() if f == "compensated"}).model
        base, after = scoring.compare([model, written], windows)
        expected = statistics.divergence(after)
        assert (kl.kl, kl.top1) == (pytest.approx(expected.kl, rel=1e-3), expected.top1), forms  # KLs of 1e-4: float32 ulps of the logits
        assert d.dnll == pytest.approx(after.loss - base.loss, abs=1e-6), forms
        runs.accept(run)
        accepted = forms
    assert (runs.passes, runs.blocks_run) == (4, 3 + 3 + 1 + 2)  # the baseline, then trials from blocks 0, 2 and 1


def test_parallel_models_have_nothing_to_select(fixture_path):
    path = fixture_path("gpt_neox_parallel")
    windows = data.windows(path, seq_len=32, max_windows=2, part="calibration")
    for fit in (None, FitSettings()):
        selection = select_layers(graph.load(path), windows, fit_windows=windows, fit=fit, settings=SelectionSettings(Budget(None, 10.0)))
        assert selection.layers == () and selection.trials == () and selection.c == (None, None, None)


class TestFused:
    """The fused form against the hooked HF model (independent) and the plain parallel graph."""

    @pytest.fixture(scope="class", params=["gpt2", "llama", "qwen2", "gpt_neox"])
    def tiny(self, request, tiny_export):
        """A tiny random model (seed 5) and its optimum export with a KV cache."""
        pytest.importorskip("torch")
        from tests.helpers import Exported

        return Exported(tiny_export(request.param, seed=5))

    @pytest.mark.parametrize("layers", [{1}, {0, 2}, {0, 1, 2}], ids=str)
    def test_fused_equals_the_hooked_parallel_model(self, tiny, layers):
        from tests.helpers import IDS, assert_logits_equal

        result = fuse(tiny.onnx, layers)
        assert_logits_equal(result.model, tiny.reference(parallel=layers))
        assert_logits_equal(result.model, logits(parallelize(tiny.onnx, layers).model, IDS))
        blocks = find_blocks(result.model)
        assert [b.form for b in blocks] == ["fused" if b.layer in layers else "sequential" for b in blocks]
        ops = [n.op_type for n in result.model.graph if n.metadata_props.get("surgery.layer") == str(min(layers))]
        assert ops.count("MatMul") == 2 and ops.count("Split") == 1  # [q|k|v|mlp in] and [o ; mlp out]
        assert fuse(result.model, layers).changed_layers == ()  # idempotent

    def test_calibrated_fused_and_plain_equal_the_hooked_model(self, tiny):
        from tests.helpers import assert_logits_equal

        alpha = {0: 0.7, 2: 1.3}
        edits = [("mlp", "scale", {layer}, a) for layer, a in alpha.items()]
        expected = tiny.reference(parallel=set(alpha), branch_edits=edits)
        for fused in (False, True):
            model = parallel_form(tiny.onnx, set(alpha), fused=fused, fixes={l: Fix.gate(a) for l, a in alpha.items()}).model
            assert_logits_equal(model, expected)

    def test_fused_kv_cache_folder_generates_like_the_hooked_model(self, tiny, tmp_path):
        import torch
        from optimum.onnxruntime import ORTModelForCausalLM

        from tests.helpers import IDS
        from tests.reference import Edits

        out = graph.write(fuse(tiny.onnx, {0, 2}).model, tmp_path / "fused", like=tiny.folder)
        prompt = torch.from_numpy(IDS[:1, :5])
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = ORTModelForCausalLM.from_pretrained(out.parent).generate(prompt, **kwargs)
        with Edits(tiny.torch, {0, 2}), torch.no_grad():
            expected = tiny.torch.generate(prompt, **kwargs)
        np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_fused_blocks_refuse_ablation_and_diagnosis(fixture_path, tmp_path):
    from surgery.diagnostics import diagnose

    model = fuse(graph.load(fixture_path("llama")), {1}).model
    with pytest.raises(SurgeryError, match="block 1 is fused"):
        ablate(model, "mlp", "radial", {1})
    assert ablate(model, "mlp", "radial", {0}).changed_layers == (0,)  # other blocks still can
    written = graph.write(model, tmp_path / "fused", like=fixture_path("llama"))
    with pytest.raises(SurgeryError, match="has fused blocks"):
        diagnose(written.parent, DiagnoseSettings(DataSettings(seq_len=32), windows=1))


def test_auto_command_writes_the_model_and_selection_json(tmp_path, fixture_path):
    out = tmp_path / "auto"
    args = ["parallelize", str(fixture_path("gpt2")), "-o", str(out), "--seq-len", "32", "--windows", "2", "--fit-windows", "8",
            "--eval-windows", "2", "--repeats", "2", "--max-loss-increase", "0.05", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    saved = json.loads((out / "selection.json").read_text())
    assert saved["selection"]["layers"] == printed["selection"]["layers"]
    assert saved["selection"]["forward_passes"] == 1 + len(saved["selection"]["trials"])
    for key in ("dnll_eval", "estimated_speedup", "prefill_ratio", "decode_ratio"):
        assert isinstance(saved[key], float)
    low, high = saved["dnll_eval_interval"]
    assert low <= saved["dnll_eval"] <= high
    written = set(saved["selection"]["forms"].values())
    assert saved["form"] == " and ".join(f for f in ("compensated", "plain") if f in written)
    windows = saved["windows"]
    assert (windows["fit"]["count"], windows["selection"]["count"], windows["evaluation"]["count"]) == (8, 2, 2)
    assert {w["seq_len"] for w in windows.values()} == {32} and all(w["tokens"] == w["count"] * 31 for w in windows.values())
    for block in saved["selection"]["blocks"]:  # every block's scores, fit and trials
        assert block["form"] in ("compensated", "plain", "sequential")
        assert block["c_comp"] is not None and block["fit"]["residual"] is not None
        assert all(t["low"] <= t["dnll"] <= t["high"] for t in block["trials"])
    chosen = saved["selection"]["layers"]
    facts = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert [b["form"] for b in facts["blocks"]] == ["parallel" if i in chosen else "sequential" for i in range(3)]
    forms = saved["selection"]["forms"]
    assert [b["fix"] for b in facts["blocks"]] == ["compensated" if forms.get(str(i)) == "compensated" else None for i in range(3)]
    # the reported evaluation dNLL is that of the written graph
    ev = data.windows(fixture_path("gpt2"), seq_len=32, max_windows=2, part="evaluation")
    measured = scoring.perplexity(out, ev).loss - scoring.perplexity(fixture_path("gpt2"), ev).loss
    assert saved["dnll_eval"] == pytest.approx(measured, abs=1e-6)
    kl = statistics.divergence(scoring.compare([fixture_path("gpt2"), out], ev)[1])
    assert saved["divergence_eval"]["kl"] == pytest.approx(kl.kl, rel=1e-5) and saved["divergence_eval"]["top1_agreement"] == kl.top1
    assert all(t["kl_low"] <= t["kl"] <= t["kl_high"] for t in saved["selection"]["trials"])


def test_a_kl_budget_keeps_the_chosen_set_inside_it(fixture_path):
    """With only --max-kl, every kept trial's set is within it and every rejected one beyond it."""
    path = fixture_path("llama")
    model = graph.load(path)
    windows = data.windows(path, seq_len=32, max_windows=4, part="calibration")
    free = select_layers(model, windows, fit=None, settings=SelectionSettings(Budget(None, 10.0)))
    limit = sorted(t.kl for t in free.trials)[1] * 1.01  # between the trials' KLs: binding, not everything
    chosen = select_layers(model, windows, fit=None, settings=SelectionSettings(Budget(limit, None)))
    assert 0 < len(chosen.layers) < 3 and chosen.divergence.kl <= limit
    assert all((t.kl <= limit) == t.kept for t in chosen.trials)


@pytest.mark.parametrize("flag, value", [("--max-kl", "0"), ("--max-kl", "-0.1"), ("--max-kl", "nan"), ("--max-kl", "lots"),
                                         ("--max-loss-increase", "-1"), ("--max-loss-increase", "inf"), ("--requantize", "rtn")])
def test_a_budget_or_option_that_is_not_one_is_one_line(fixture_path, tmp_path, flag, value):
    result = runner.invoke(app, ["parallelize", str(fixture_path("llama")), "-o", str(tmp_path / "out"), flag, value])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and flag in result.stderr
    assert not (tmp_path / "out").exists()


def test_auto_on_a_bare_onnx_file(tmp_path, fixture_path):
    bare = tmp_path / "bare.onnx"
    bare.write_bytes((fixture_path("llama") / "model.onnx").read_bytes())
    args = ["parallelize", str(bare), "-o", str(tmp_path / "out.onnx"), "--seq-len", "32", "--windows", "2",
            "--fit-windows", "8", "--eval-windows", "2", "--no-latency", "--fuse"]
    missing = runner.invoke(app, args)
    assert missing.exit_code == 1 and "--tokenizer" in missing.stderr
    done = runner.invoke(app, args + ["--tokenizer", str(fixture_path("llama") / "tokenizer.json")])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "out.onnx").is_file() and (tmp_path / "out.selection.json").is_file()
    assert (tmp_path / "out.selection.png").read_bytes().startswith(b"\x89PNG")  # the picture beside it, named like it
    assert "form fused compensated" in done.stdout and "forward passes" in done.stdout


def test_compensated_selection_reports_what_the_rewritten_graph_does(fixture_path):
    """The switchboard's compensated trials equal the compensate pass: the selection dNLL is that of
    the graph parallel_form() writes, scored independently on the same windows."""
    path = fixture_path("llama")
    model = graph.load(path)
    cal = data.windows(path, seq_len=32, max_windows=20, part="calibration")
    fit_windows, windows = data.deal(cal, [16, 4], ["fit", "selection"])
    assert not set(fit_windows.starts) & set(windows.starts)
    selection = select_layers(model, windows, fit_windows=fit_windows, settings=SelectionSettings(Budget(None, 10.0), try_both=True))
    assert selection.layers == (0, 1, 2) and set(selection.forms.values()) <= {"compensated", "plain"}
    assert [t.form for t in selection.trials] == ["compensated", "plain"] * 3  # both forms, every candidate
    assert selection.score == "c_comp"
    scores = [selection.c_comp[t.layer] for t in selection.trials[::2]]
    assert scores == sorted(scores)
    base = scoring.perplexity(model, windows)
    for t in selection.trials[:2]:  # the first candidate alone, each form, against the passes
        fixes = {t.layer: selection.fits[t.layer].fix} if t.form == "compensated" else {}
        graph_dnll = scoring.perplexity(parallel_form(model, [t.layer], fixes=fixes).model, windows).loss - base.loss
        assert t.dnll == pytest.approx(graph_dnll, abs=1e-5)
        kl = statistics.divergence(scoring.compare([model, parallel_form(model, [t.layer], fixes=fixes).model], windows)[1])
        assert (t.kl, t.top1) == (pytest.approx(kl.kl, rel=1e-4, abs=1e-7), pytest.approx(kl.top1))
    written = parallel_form(model, selection.layers, fixes=selection.fixes).model
    assert selection.dnll.dnll == pytest.approx(scoring.perplexity(written, windows).loss - base.loss, abs=1e-5)
    kl = statistics.divergence(scoring.compare([model, written], windows)[1])
    assert selection.divergence.kl == pytest.approx(kl.kl, rel=1e-4, abs=1e-7)
    kept = [t for t in selection.trials if t.kept]
    assert sorted((t.layer, t.form) for t in kept) == sorted(selection.forms.items())
    assert all(t.dnll == min(u.dnll for u in selection.trials if u.layer == t.layer) for t in kept)  # the better form


def test_plain_is_tried_after_a_failed_compensated_trial_only_for_a_bad_fit():
    from surgery.compensation.equations import FitResult

    good = FitResult(0, Fix.gate(0.9), None, 0.4, 0.01, 100, scores={"c_stream": 0.02})
    bad = dataclasses.replace(good, residual=1.7)
    failed = dataclasses.replace(good, fix=None, residual=None)
    assert forms_to_try(0, {0: good}, False) == ("compensated",)
    assert forms_to_try(0, {0: bad}, False) == ("compensated", "plain")
    assert forms_to_try(0, {0: failed}, False) == ("plain",)
    assert forms_to_try(0, {}, False) == ("plain",)
    assert forms_to_try(0, {0: good}, True) == ("compensated", "plain")


def test_refit_with_the_chosen_blocks_in_place(fixture_path):
    path = fixture_path("gpt2")
    model = graph.load(path)
    fit_windows, windows = data.deal(data.windows(path, seq_len=32, max_windows=20, part="calibration"), [16, 4], ["fit", "selection"])
    selection = select_layers(model, windows, fit_windows=fit_windows, settings=SelectionSettings(Budget(None, 10.0), refit=True))
    r = selection.refit
    assert r is not None and r["layers"] == sorted(l for l, f in selection.forms.items() if f == "compensated")
    # the refit changed the fixes: the chosen set scores otherwise (the tiny model's parallel blocks move dNLL by 1e-5,
    # where float32 sums can leave the point estimate equal: the whole statistics are compared)
    assert (r["dnll_before"], r["kl_before"]) != (r["dnll_after"], r["kl_after"])
    assert selection.fit_passes == 3  # the input side's and the output side's, then the refit's (the refit keeps the input sides)
    expected = r["dnll_after"] if r["kept"] else r["dnll_before"]
    assert selection.dnll.dnll == pytest.approx(expected["dnll"])
    base = scoring.perplexity(model, windows).loss
    written = parallel_form(model, selection.layers, fixes=selection.fixes).model
    assert selection.dnll.dnll == pytest.approx(scoring.perplexity(written, windows).loss - base, abs=1e-5)


def test_bad_compensation_requests_are_one_line(fixture_path, tmp_path):
    cases = [
        (["parallelize", str(fixture_path("gpt_neox_parallel")), "--layers", "0", "--compensate"], "parallel in the model as exported"),
        (["parallelize", str(fixture_path("llama")), "--layers", "1", "--calibrate", "--no-compensate"], "--calibrate is a form of compensation"),
        (["parallelize", str(fixture_path("llama")), "--score", "c_comp", "--no-compensate", "--windows", "1"], "c_comp needs compensation"),
    ]
    fused = tmp_path / "fused"
    assert runner.invoke(app, ["parallelize", str(fixture_path("llama")), "--layers", "1", "--fuse", "-o", str(fused)]).exit_code == 0
    cases.append((["parallelize", str(fused), "--layers", "1", "--compensate", "--seq-len", "32", "--fit-windows", "4"], "block 1: it is fused"))
    for args, message in cases:
        out = tmp_path / "out"
        result = runner.invoke(app, args + ["-o", str(out)])
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
        assert not out.exists()


def test_explicit_layers_with_compensate_fold_the_fitted_fix(fixture_path, tmp_path):
    out = tmp_path / "comp"
    result = runner.invoke(app, ["parallelize", str(fixture_path("llama")), "--layers", "0,2", "--compensate",
                                 "--seq-len", "32", "--fit-windows", "8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    facts = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert [b["fix"] for b in facts["blocks"]] == ["compensated", None, "compensated"]
    shown = runner.invoke(app, ["inspect", str(out)]).stdout
    assert "parallel (compensated)" in shown and "compensate layers=[0, 2]" in shown


def test_patience_stops_after_that_many_misses_in_a_row(fixture_path):
    path = fixture_path("llama")
    model = graph.load(path)
    windows = data.windows(path, seq_len=32, max_windows=4, part="calibration")
    stopped = select_layers(model, windows, fit=None, settings=SelectionSettings(Budget(1e-9, None), patience=2))
    assert len(stopped.trials) == 2 and not stopped.layers and stopped.candidates == 3 and "2 candidates in a row" in stopped.stopped
    every = select_layers(model, windows, fit=None, settings=SelectionSettings(Budget(1e-9, None)))
    assert len(every.trials) == 3 and every.stopped is None


def test_a_compensation_that_cannot_be_made_is_never_silent(fixture_path, tmp_path):
    """One fit window cannot hold a fold out, so no fix can be fitted: explicit --compensate is an error;
    auto writes the blocks plain, says so per block, ranks them by their plain score and reports the form written."""
    path = fixture_path("llama")
    out = tmp_path / "explicit"
    result = runner.invoke(app, ["parallelize", str(path), "--layers", "1", "--compensate", "--seq-len", "32", "--fit-windows", "1", "-o", str(out)])
    assert result.exit_code == 1 and not out.exists()
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "error: cannot compensate block 1: too few windows" in result.stderr

    out = tmp_path / "auto"
    result = runner.invoke(app, ["parallelize", str(path), "--seq-len", "32", "--fit-windows", "1", "--windows", "2", "--eval-windows", "2",
                                 "--no-latency", "--max-kl", "none", "--max-loss-increase", "none", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "selection.json").read_text())
    sel = saved["selection"]
    assert sel["layers"] == [0, 1, 2] and set(sel["forms"].values()) == {"plain"} and saved["form"] == "plain"
    warnings = said(result.stderr)
    assert warnings == [f"warning: block {l} was written plain parallel: its fix could not be made "
                        f"(too few windows to hold one fold out; give more fit windows)" for l in (0, 1, 2)]
    assert set(sel["uncompensated"]) == {"0", "1", "2"}
    c_stream = {b["layer"]: b["c_stream"] for b in sel["blocks"]}
    assert all(b["c_comp"] is None for b in sel["blocks"])
    assert [t["layer"] for t in sel["trials"]] == sorted(c_stream, key=c_stream.get)  # ranked by the plain score
    assert [t["score"] for t in sel["trials"]] == [c_stream[t["layer"]] for t in sel["trials"]]
    facts = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert [(b["form"], b["fix"]) for b in facts["blocks"]] == [("parallel", None)] * 3


def test_auto_fuse_refuses_a_block_it_cannot_fuse_before_any_work(fixture_path, tmp_path, monkeypatch):
    import onnx

    from surgery import compensation
    from surgery.jobs import job

    folder = tmp_path / "llama"
    folder.mkdir()
    for f in fixture_path("llama").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    proto = onnx.load(folder / "model.onnx")
    add = next(n for n in proto.graph.node if n.name == "/model/layers.1/input_layernorm/Add")
    add.input[1], abs_eps = "eps_computed", onnx.helper.make_node("Abs", [add.input[1]], ["eps_computed"], name="eps_abs")
    proto.graph.node.insert(list(proto.graph.node).index(add), abs_eps)  # epsilon no longer one constant: block 1 cannot be fused
    onnx.save(proto, folder / "model.onnx")
    monkeypatch.setattr(compensation, "fit", lambda *a, **k: pytest.fail("the fit ran before the refusal"))
    with pytest.raises(SurgeryError, match="cannot fuse block 1: the normalisations' epsilon is not one constant"):
        job.auto(folder, tmp_path / "out", job.JobSettings(DataSettings(seq_len=32), FitSettings(windows=4), SelectionSettings(windows=2), eval_windows=2,
                                                       fused=True, latency=LatencySettings(measure=False)))
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    result = runner.invoke(app, ["parallelize", str(folder), "--fuse", "--protect-first", "2", "--seq-len", "32", "--windows", "2",
                                 "--fit-windows", "4", "--eval-windows", "2", "--no-latency", "-o", str(tmp_path / "protected")])
    assert result.exit_code == 0, result.output  # block 1 protected: nothing to refuse


def test_fit_memory_sets_the_passes_and_the_fit_reports_its_time_split(fixture_path, tmp_path):
    from surgery.compensation.equations import NormalEquations
    from surgery.model.embedding import embedding_table

    path = fixture_path("llama")
    model = graph.load(path)
    windows = data.windows(path, seq_len=16, max_windows=4, part="calibration")
    one_layer = NormalEquations.nbytes(embedding_table(model)[1])
    loose_budget = SelectionSettings(Budget(None, 10.0))
    tight = select_layers(model, windows, fit_windows=windows, fit=FitSettings(memory=one_layer), settings=loose_budget)
    loose = select_layers(model, windows, fit_windows=windows, fit=FitSettings(memory="1G"), settings=loose_budget)
    assert (tight.fit_passes, loose.fit_passes) == (6, 2)  # each chunk: the input side's pass and the output side's
    # ORT fuses the graphs of one and of three blocks differently: float32 activations a few ulps apart
    assert tight.layers == loose.layers and tight.c_comp == pytest.approx(loose.c_comp, rel=1e-5)
    for bad in ("lots", "0", "-1G"):
        result = runner.invoke(app, ["parallelize", str(path), "--fit-memory", bad, "-o", str(tmp_path / "out")])
        assert result.exit_code == 1 and result.stderr.strip().startswith("error:") and "--fit-memory" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
