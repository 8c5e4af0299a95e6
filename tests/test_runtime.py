"""runtime: the IO-binding path (bound on CPU host buffers here, on the device under CUDA) and the CUDA benchmark's refusal."""

import subprocess
import sys

import numpy as np
import pytest

from surgery import runtime
from tests.conftest import ROOT


@pytest.fixture
def llama(fixture_path):
    sess = runtime.session(fixture_path("llama"), runtime.Options(device="cpu"))
    return sess, np.random.default_rng(0).integers(0, 512, size=(2, 17))


def test_a_bound_prefill_gives_what_sess_run_gives(llama):
    sess, ids = llama
    inputs = runtime.feeds(sess, ids[:, :16])
    run = runtime.Prepared(sess, inputs, bind=True)
    assert run.binding is not None and runtime.Prepared(sess, inputs).binding is None  # CPU binds only when asked
    run()
    outputs = run.outputs()
    assert all(v.device_name() == "cpu" for v in outputs)
    for expected, got in zip(sess.run(None, inputs), outputs, strict=True):
        np.testing.assert_array_equal(got.numpy(), expected)


def test_a_bound_decode_reads_the_bound_prefills_present_as_its_past(llama):
    sess, ids = llama
    inputs = runtime.feeds(sess, ids[:, :16])
    prefill = runtime.Prepared(sess, inputs, bind=True)
    prefill()
    decode = runtime.Prepared(sess, runtime.decode_inputs(prefill, ids[:, 16:]), bind=True)
    assert decode.inputs["past_key_values.0.key"].shape() == [2, 2, 16, 16] and (decode.inputs["position_ids"].numpy() == 16).all()
    inputs["input_ids"][:] = 0  # the bound CPU input reads this buffer: the next prefill computes another present,
    prefill()  # in its old output buffers, so a past handed over from them would change under the decode
    decode()
    past = runtime.present_as_past(sess, sess.run(None, runtime.feeds(sess, ids[:, :16])))
    for expected, got in zip(sess.run(None, runtime.feeds(sess, ids[:, 16:], past)), decode.outputs(), strict=True):
        np.testing.assert_array_equal(got.numpy(), expected)


def test_an_unbound_decode_step_matches_the_bound_one(llama):
    sess, ids = llama
    steps = []
    for bind in (False, True):
        prefill = runtime.Prepared(sess, runtime.feeds(sess, ids[:, :16]), bind=bind)
        prefill()
        steps.append(runtime.Prepared(sess, runtime.decode_inputs(prefill, ids[:, 16:]), bind=bind))
        steps[-1]()
    plain, bound = (s.outputs()[0] for s in steps)
    np.testing.assert_array_equal(bound.numpy(), plain)


@pytest.mark.skipif(runtime.cuda_usable(), reason="this machine has a usable CUDA provider")
def test_the_cuda_benchmark_says_in_one_line_that_it_needs_a_gpu():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda.py")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "needs an NVIDIA GPU" in done.stderr


def test_two_onnxruntime_builds_get_one_warning_line(monkeypatch, fixture_path):
    import importlib.metadata
    import types

    from typer.testing import CliRunner

    from surgery.cli import app

    def installed(*names):
        return lambda: [types.SimpleNamespace(metadata={"Name": n}) for n in names]

    monkeypatch.setattr(importlib.metadata, "distributions", installed("numpy", "onnxruntime-gpu"))
    assert runtime.clashing_builds() is None
    monkeypatch.setattr(importlib.metadata, "distributions", installed("onnxruntime-gpu", "onnxruntime", "numpy"))
    clash = runtime.clashing_builds()
    assert "onnxruntime and onnxruntime-gpu" in clash and "pip install onnxruntime-gpu`" in clash
    result = CliRunner().invoke(app, ["evaluate", str(fixture_path("llama")), "--max-windows", "1", "--seq-len", "16", "--no-latency"])
    assert result.exit_code == 0 and result.stderr.splitlines() == [f"warning: {clash}"]
