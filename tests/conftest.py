import copy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # fixtures.make_fixtures (tiny model builders) and tests.reference

FIXTURES = ROOT / "fixtures"


@pytest.fixture
def fixture_path():
    """Path of a committed tiny exported model: fixture_path('llama') -> fixtures/tiny-llama."""
    return lambda family: FIXTURES / f"tiny-{family.replace('_', '-')}"


# SmolLM2 as transformers loaded it (GGUF dequantized, tokenizer converted: 40 of the 60 s an
# export takes), kept from the fp32 export for the fp16 one.
_LOADED: dict = {}


def _load_once(load):
    def cached(src, *args, **kwargs):
        key = (src.path, src.gguf_file)
        if key not in _LOADED:
            _LOADED[key] = load(src, *args, **kwargs)
        model, tokenizer = _LOADED[key]
        return copy.deepcopy(model), tokenizer  # export may cast its model to float16 in place

    return cached


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real SmolLM2-135M exported by `surgery export smollm2-135m` (fp32, KV cache), once per session."""
    from typer.testing import CliRunner

    from surgery import export
    from surgery.cli import app

    folder = tmp_path_factory.mktemp("smollm2") / "onnx"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "_load", _load_once(export._load))
        result = CliRunner().invoke(app, ["export", "smollm2-135m", "-o", str(folder)])
    assert result.exit_code == 0, result.output
    return folder


@pytest.fixture(scope="session")
def smollm2_fp16(smollm2, tmp_path_factory):
    """The same model exported with dtype fp16, from the model the fp32 export loaded."""
    from surgery import export

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "_load", _load_once(export._load))
        folder = export.export("smollm2-135m", tmp_path_factory.mktemp("smollm2-fp16") / "onnx", dtype="fp16").folder
    _LOADED.clear()
    return folder


def _numpy_divergence(first, other, windows) -> dict:
    """Mean token KL(first || other), its 99th percentile and top-1 agreement over the scored positions of
    `windows`, from each graph's raw logits with log-softmax in float64 NumPy."""
    import numpy as np

    from surgery import runtime

    sessions = [runtime.session(m) for m in (first, other)]
    kl, agree = [], []
    for row, start in zip(windows.ids, windows.score_from):
        logp = []
        for sess in sessions:
            logits = sess.run(["logits"], runtime.feeds(sess, row[None]))[0][0].astype(np.float64)
            shifted = logits - logits.max(-1, keepdims=True)
            logp.append(shifted - np.log(np.exp(shifted).sum(-1, keepdims=True)))
        scored = slice(start, len(row) - 1)
        p, q = logp[0][scored], logp[1][scored]
        kl += list((np.exp(p) * (p - q)).sum(-1))
        agree += list(p.argmax(-1) == q.argmax(-1))
    return {"kl": float(np.mean(kl)), "p99": float(np.percentile(kl, 99)), "top1": float(np.mean(agree))}


@pytest.fixture
def numpy_divergence():
    """numpy_divergence(first, other, windows) -> {"kl", "p99", "top1"}: the independent reference for evaluate's KL."""
    return _numpy_divergence
