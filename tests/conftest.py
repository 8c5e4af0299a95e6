import contextlib
import copy
import dataclasses
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # graphs.make_fixtures (the tiny families) and tests.reference


@pytest.fixture
def fixture_path():
    """Path of a committed tiny exported model: fixture_path('llama') -> graphs/tiny-llama (tests.helpers.FAMILIES'
    families with a fixture_ln)."""
    from tests.helpers import FAMILIES

    def path(family):
        assert FAMILIES[family].fixture_ln, f"{family} has no committed export"
        return FAMILIES[family].folder

    return path


@dataclasses.dataclass(frozen=True)
class TinyExport:
    """A tiny random HF model folder and its ONNX export, shared by every test of the session: read them,
    never write into them (copy a folder first to change it)."""

    hf: Path
    onnx: Path  # the folder `surgery.files.export.export` wrote: model.onnx, config, tokenizer


class TinyExports:
    """tiny_export(family, exporter, past, seed, dtype, **config) -> TinyExport, each key built once.

    Under xdist the workers share one folder per key (basetemp's parent, the run's own), built by whichever
    worker asks first while the others wait on its file lock; without `filelock` each worker builds its own."""

    def __init__(self, root: Path, shared: bool):
        self.root, self.shared, self._seen = root, shared, {}
        root.mkdir(parents=True, exist_ok=True)

    def hf(self, family: str, seed: int = 5, **config) -> Path:
        """The HF folder of tests.helpers.save_tiny(family, seed=seed, **config)."""
        from tests.helpers import save_tiny

        return self._once(_name("hf", family, seed, config), lambda folder: save_tiny(family, folder, seed=seed, **config))

    def __call__(self, family: str, exporter: str = "optimum", past: bool = True, seed: int = 5, dtype: str = "fp32", **config) -> TinyExport:
        from surgery.files.export import export

        hf = self.hf(family, seed, **config)
        name = _name(f"{exporter}-{'past' if past else 'nopast'}-{dtype}", family, seed, config)
        return TinyExport(hf, self._once(name, lambda folder: export(str(hf), folder, past=past, exporter=exporter, dtype=dtype).folder))

    def _once(self, name: str, make) -> Path:
        folder = self.root / name
        if name not in self._seen:
            done = self.root / f"{name}.done"
            with self._lock(name):
                if not done.exists():
                    shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
                    make(folder)
                    done.touch()
            self._seen[name] = _listing(folder)
        return folder

    def _lock(self, name: str):
        if not self.shared:
            return contextlib.nullcontext()
        import filelock

        return filelock.FileLock(self.root / f"{name}.lock")

    def changed(self) -> list[str]:
        """The cached folders whose files (names, sizes, mtimes) differ from when this process first used them."""
        return [name for name, listing in self._seen.items() if _listing(self.root / name) != listing]


def _name(kind: str, family: str, seed: int, config: dict) -> str:
    overrides = "".join(f"-{k}={v}" for k, v in sorted(config.items()))
    return f"{family}-{kind}-seed{seed}{overrides}"


def _listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """tiny_export(family, exporter="optimum", past=True, seed=5, dtype="fp32", **config) -> TinyExport (.hf, .onnx):
    a tiny random HF model (tests.helpers.save_tiny) and its export, built once per key for the whole run.
    `.hf(family, seed, **config)` is the HF folder alone. The folders are read-only to tests: the session
    fails at its end if one changed."""
    try:
        import filelock  # noqa: F401

        shared = "PYTEST_XDIST_WORKER" in os.environ
    except ImportError:
        shared = False
    base = tmp_path_factory.getbasetemp()
    cache = TinyExports((base.parent if shared else base) / "tiny-exports", shared)
    yield cache
    changed = cache.changed()
    assert not changed, f"tests wrote into the shared tiny exports {changed}; copy a folder before changing it"


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

    from surgery.cli import app
    from surgery.files import export

    folder = tmp_path_factory.mktemp("smollm2") / "onnx"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "_load", _load_once(export._load))
        result = CliRunner().invoke(app, ["export", "smollm2-135m", "-o", str(folder)])
    assert result.exit_code == 0, result.output
    return folder


@pytest.fixture(scope="session")
def smollm2_fp16(smollm2, tmp_path_factory):
    """The same model exported with dtype fp16, from the model the fp32 export loaded."""
    from surgery.files import export

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "_load", _load_once(export._load))
        folder = export.export("smollm2-135m", tmp_path_factory.mktemp("smollm2-fp16") / "onnx", dtype="fp16").folder
    _LOADED.clear()
    return folder


def _numpy_divergence(first, other, windows) -> dict:
    """Mean token KL(first || other), its 99th percentile and top-1 agreement over the scored positions of
    `windows`, from each graph's raw logits with log-softmax in float64 NumPy."""
    import numpy as np

    from surgery.engine import runtime

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
