"""Scoring on Ray actors gives the numbers of the in-process run."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from surgery import cluster, runtime
from surgery.cli import app
from surgery.diagnostics import diagnose
from surgery.diagnostics.diagnose import _diagnose

pytestmark = pytest.mark.xdist_group("ray")  # one local Ray cluster at a time


def _leaves(x, path=""):
    """(path, number) of every number in a report, its timings left out."""
    if isinstance(x, dict):
        for key, value in x.items():
            if key != "seconds":
                yield from _leaves(value, f"{path}/{key}")
    elif isinstance(x, (list, tuple)):
        for i, value in enumerate(x):
            yield from _leaves(value, f"{path}/{i}")
    elif isinstance(x, float):
        yield path, x


def test_diagnose_on_a_local_2_cpu_ray_cluster_equals_the_in_process_run(fixture_path):
    """The probe's windows and the chunks of the evaluation window's loss runs spread over two actors."""
    pytest.importorskip("ray")
    kwargs = dict(seq_len=32, windows=3, eval_windows=1, only=("deficit", "diversity", "defect", "gate", "ablation"))
    here = dict(_leaves(diagnose(fixture_path("llama"), options=runtime.Options(threads=1), **kwargs)))  # one run at a time
    there = dict(_leaves(diagnose(fixture_path("llama"), workers=2, **kwargs)))
    assert there.keys() == here.keys() and len(here) > 100
    for path, value in here.items():
        assert there[path] == pytest.approx(value, rel=1e-9, abs=1e-12), path


def test_concurrent_runs_in_process_equal_one_run_at_a_time(fixture_path):
    """Two probe windows, and two chunks of an evaluation window's loss runs, at a time on one session's threads
    give the numbers of one run at a time."""
    kwargs = dict(seq_len=32, windows=3, eval_windows=1, only=("deficit", "diversity", "defect", "gate", "ablation"),
                  options=runtime.analysis(runtime.Options(threads=1)))
    here = dict(_leaves(_diagnose(fixture_path("llama"), **kwargs)))
    with cluster.pool(concurrent=2) as pool:
        assert pool.parallel == 2
        there = dict(_leaves(_diagnose(fixture_path("llama"), pool=pool, **kwargs)))
    assert there.keys() == here.keys() and len(here) > 100
    for path, value in here.items():
        assert there[path] == pytest.approx(value, rel=1e-9, abs=1e-12), path


def test_concurrency_is_left_to_the_user_when_threads_are_given(monkeypatch):
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 2)
    assert cluster.concurrency(runtime.Options(device="cpu")) == 2
    assert cluster.concurrency(runtime.Options(device="cpu", threads=2)) == 1
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 1)
    assert cluster.concurrency(runtime.Options(device="cpu")) == 1


def test_workers_without_ray_is_one_line(fixture_path, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = CliRunner().invoke(app, ["diagnose", str(fixture_path("llama")), "-o", str(tmp_path / "r"), "--workers", "2"])
    assert result.exit_code == 1
    assert result.output.strip() == "error: --workers and --ray need Ray; run `pip install 'surgery[ray]'`"
    assert not (tmp_path / "r").exists()


def test_diagnose_on_ray_from_the_cli_prints_no_ray_notices(fixture_path, tmp_path):
    """Ray's start-up notices (token authentication) are third-party chatter: shown with --verbose only."""
    pytest.importorskip("ray")
    args = ["diagnose", str(fixture_path("llama")), "--workers", "2", "--seq-len", "32", "--windows", "2", "--only", "deficit"]
    quiet = subprocess.run([sys.executable, "-m", "surgery.cli", *args, "-o", str(tmp_path / "q")], capture_output=True, text=True)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "" and (tmp_path / "q" / "report.json").exists()


@pytest.mark.slow
def test_auto_selection_on_ray_actors_equals_the_in_process_run(fixture_path, tmp_path):
    pytest.importorskip("ray")
    from surgery import select

    kwargs = dict(seq_len=32, fit_windows=4, windows=8, eval_windows=2, measure_latency=False, budget=select.Budget(None, 1.0))
    here, _ = select.auto(fixture_path("llama"), tmp_path / "here", options=runtime.Options(threads=1), **kwargs)
    there, _ = select.auto(fixture_path("llama"), tmp_path / "there", workers=2, **kwargs)
    assert there.selection.layers == here.selection.layers and len(here.selection.trials) >= 3
    for a, b in zip(here.selection.trials, there.selection.trials):
        assert (a.layer, a.form, a.kept) == (b.layer, b.form, b.kept)
        assert b.dnll == pytest.approx(a.dnll, rel=1e-9, abs=1e-12)
        assert b.kl == pytest.approx(a.kl, rel=1e-9, abs=1e-12)  # the reference log-probs travel to the actors
