"""Failures a user can cause end in one `error:` line, exit 1, no partial output, and the input unchanged."""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

from surgery.cli import _QUIET_ENV, app
from surgery.engine import runtime
from surgery.files import graph, output
from tests.helpers import said

runner = CliRunner()


def _hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _one_error_line(result, message):
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def _copy(fixture_path, tmp_path):
    src = tmp_path / "in"
    shutil.copytree(fixture_path("llama"), src)
    return src, _hashes(src)


def _failing_save(exc):
    def save(*args, **kwargs):
        raise exc

    return save


@pytest.mark.parametrize(
    "exc, message",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device writing"),
        (PermissionError(errno.EACCES, "Permission denied"), "permission denied; choose an -o you can write to"),
        (KeyboardInterrupt(), "interrupted; nothing partial was left behind"),
    ],
    ids=["full disk", "permission denied", "interrupted"],
)
@pytest.mark.parametrize("shape", ["folder", "file"])
def test_a_failed_write_is_one_line_and_leaves_nothing(tmp_path, fixture_path, monkeypatch, exc, message, shape):
    src, before = _copy(fixture_path, tmp_path)
    target = tmp_path / ("out" if shape == "folder" else "out.onnx")
    given = src if shape == "folder" else src / "model.onnx"
    monkeypatch.setattr(ir, "save", _failing_save(exc))
    result = runner.invoke(app, ["ablate", str(given), "--mode", "remove", "-o", str(target)])
    _one_error_line(result, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no output, no hidden partial
    assert _hashes(src) == before


def test_a_full_disk_says_how_much_was_needed_and_where(tmp_path, fixture_path, monkeypatch):
    src, _ = _copy(fixture_path, tmp_path)
    monkeypatch.setattr(ir, "save", _failing_save(OSError(errno.ENOSPC, "No space left on device")))
    result = runner.invoke(app, ["parallelize", str(src), "--layers", "1", "-o", str(tmp_path / "out")])
    _one_error_line(result, "no space left")
    needed = graph._bytes(graph.load(src))
    assert f"about {needed / 2**20:.0f} MiB needed" in result.stderr and f"free in {tmp_path}" in result.stderr


def test_too_little_free_space_is_refused_before_any_work(tmp_path, fixture_path, monkeypatch):
    src, _ = _copy(fixture_path, tmp_path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    monkeypatch.setattr(ir, "save", _failing_save(AssertionError("nothing may be written")))
    result = runner.invoke(app, ["parallelize", str(src), "--layers", "1", "--compensate", "-o", str(tmp_path / "out")])
    _one_error_line(result, "no space left on the device writing")
    assert "0 MiB free" in result.stderr


def test_an_unwritable_folder_is_refused_before_any_work(tmp_path, fixture_path, monkeypatch):
    src, _ = _copy(fixture_path, tmp_path)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path / "locked") else real(path, mode))
    (tmp_path / "locked").mkdir()
    result = runner.invoke(app, ["diagnose", str(src), "-o", str(tmp_path / "locked" / "report")])
    _one_error_line(result, f"cannot write {tmp_path / 'locked' / 'report'}: permission denied")
    assert list((tmp_path / "locked").iterdir()) == []


def test_sigterm_leaves_nothing_behind(tmp_path, fixture_path):
    """A real process, terminated while it writes: the partial folder goes, the message is one line."""
    src, before = _copy(fixture_path, tmp_path)
    script = (
        "import sys, time, onnx_ir as ir\n"
        "def slow(*a, **k):\n"
        "    print('writing', flush=True); time.sleep(30)\n"
        "ir.save = slow\n"
        "from surgery.cli import app\n"
        "sys.argv = ['surgery', 'ablate', sys.argv[1], '-o', sys.argv[2]]\n"
        "app()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(src), str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "writing"
    assert any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir())
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and err.startswith("error: interrupted") and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    assert _hashes(src) == before


def test_stale_partials_of_dead_processes_are_swept(tmp_path, fixture_path):
    src, _ = _copy(fixture_path, tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.partial-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "model.onnx").write_bytes(b"half a model")
    stale_old = tmp_path / f".out.old-{int(dead.stdout)}"
    stale_old.mkdir()
    live = tmp_path / f".out.partial-{os.getppid()}"  # a process that is running: its write is not ours to remove
    live.mkdir()
    other = tmp_path / f".other.partial-{int(dead.stdout)}"  # another output's leftover: not swept by this write
    other.mkdir()
    result = runner.invoke(app, ["ablate", str(src), "--mode", "remove", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert not stale.exists() and not stale_old.exists()
    assert live.exists() and other.exists() and (tmp_path / "out" / "model.onnx").is_file()


def test_the_shown_path_is_the_final_one(tmp_path):
    partial = tmp_path / ".out.partial-123" / "model.onnx"
    line = output.explain(OSError(errno.ENOSPC, "No space left on device"), partial, 3 * 2**20)
    assert f"writing {tmp_path / 'out' / 'model.onnx'} (about 3 MiB needed" in line and ".partial" not in line


def test_an_export_folder_without_tokenizer_exports_and_says_what_evaluate_needs(tmp_path):
    from graphs.make_fixtures import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "hf")  # weights and config, no tokenizer files
    before = _hashes(tmp_path / "hf")

    def export(*flags):
        out = tmp_path / f"onnx{len(flags)}"
        env = {k: v for k, v in os.environ.items() if k not in _QUIET_ENV}  # in-process CLI runs of other tests set them
        return subprocess.run([sys.executable, "-m", "surgery.cli", *flags, "export", str(tmp_path / "hf"), "-o", str(out)],
                              capture_output=True, text=True, env=env)

    quiet, loud = export(), export("--verbose")
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr
    assert "no usable tokenizer" in quiet.stdout and "--tokenizer" in quiet.stdout
    # transformers fails to convert a tokenizer that is not there, and says so at length: only with --verbose
    assert said(quiet.stderr) == [] and "legacy" in loud.stderr  # progress lines aside (a slow export writes `still working`)
    assert (tmp_path / "onnx0" / "model.onnx").is_file() and not (tmp_path / "onnx0" / "tokenizer.json").exists()
    assert _hashes(tmp_path / "hf") == before
    result = runner.invoke(app, ["evaluate", str(tmp_path / "onnx0"), "--no-latency"])
    _one_error_line(result, "tokenizer")


def _symbolic_kv(src, dest, config: bool):
    model = graph.load(src / "model.onnx")
    for value in model.graph.inputs:
        if value.name.startswith("past_key_values"):
            value.shape = ir.Shape(["batch_size", "kv_heads", "past_sequence_length", "head_size"])
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json") + (("config.json",) if config else ()):
        shutil.copy(src / name, dest / name)
    ir.save(model, dest / "model.onnx")


def test_symbolic_kv_sizes_come_from_the_config_or_a_line_says_what_to_do(tmp_path, fixture_path):
    src = fixture_path("llama")
    _symbolic_kv(src, tmp_path / "with", config=True)
    _symbolic_kv(src, tmp_path / "without", config=False)
    args = ["--max-windows", "2", "--seq-len", "32", "--json", "--no-latency"]
    base = runner.invoke(app, ["evaluate", str(src), *args])
    same = runner.invoke(app, ["evaluate", str(tmp_path / "with"), *args])
    assert base.exit_code == 0 and same.exit_code == 0, same.output
    losses = [json.loads(r.stdout)["models"][0]["loss"] for r in (base, same)]
    assert np.isclose(losses[0], losses[1], rtol=0, atol=1e-6)
    config = json.loads((src / "config.json").read_text())
    kv = [v for v in graph.load(tmp_path / "with").graph.inputs if v.name.startswith("past_key_values")]
    head = config["hidden_size"] // config["num_attention_heads"]
    assert all(list(v.shape)[1::2] == [config["num_key_value_heads"], head] for v in kv)
    result = runner.invoke(app, ["evaluate", str(tmp_path / "without"), *args])
    _one_error_line(result, "leaves the number of KV heads or the head size symbolic")


def test_external_data_is_copied_when_still_used_and_rewritten_when_mostly_replaced(tmp_path, fixture_path):
    from surgery.passes import fuse, parallelize

    src = tmp_path / "in"
    shutil.copytree(fixture_path("llama"), src)
    ir.save(graph.load(src), src / "model.onnx", external_data="weights.data", size_threshold_bytes=0)
    model = graph.load(src)
    data_bytes = (src / "weights.data").stat().st_size

    def run(m):
        s = runtime.session(m)
        return s.run(["logits"], runtime.feeds(s, np.arange(1, 9)[None]))[0]

    plain = parallelize(model, {1}).model  # every weight still used: the file is copied as it is
    graph.write(plain, tmp_path / "plain", like=src)
    assert _hashes(tmp_path / "plain")["weights.data"] == _hashes(src)["weights.data"]
    fused = fuse(model, {0, 1, 2}).model  # most block weights replaced: what is still used is written anew
    graph.write(fused, tmp_path / "fused", like=src)
    files = {p.name: p.stat().st_size for p in (tmp_path / "fused").iterdir() if p.name.endswith(".data")}
    assert "weights.data" not in files and sum(files.values()) < 1.2 * data_bytes
    for rewritten, out in ((plain, "plain"), (fused, "fused")):
        np.testing.assert_allclose(run(graph.load(tmp_path / out)), run(rewritten), rtol=0, atol=0)
