"""Scoring on Ray actors gives the numbers of the in-process run."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from surgery.cli import app
from surgery.compensation.fitting import FitSettings
from surgery.diagnostics import DiagnoseSettings, diagnose
from surgery.diagnostics.diagnose import _diagnose
from surgery.engine import cluster, runtime
from surgery.engine.cluster import Resources
from surgery.errors import SurgeryError
from surgery.jobs.job import JobSettings
from surgery.measure.timing import LatencySettings
from surgery.text.data import DataSettings
from tests.helpers import said

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
    settings = DiagnoseSettings(DataSettings(seq_len=32), windows=3, eval_windows=1, only=("deficit", "diversity", "defect", "gate", "ablation"))
    here = dict(_leaves(diagnose(fixture_path("llama"), settings, Resources(runtime.Options(threads=1))).to_json()))  # one run at a time
    there = dict(_leaves(diagnose(fixture_path("llama"), settings, Resources(workers=2)).to_json()))
    assert there.keys() == here.keys() and len(here) > 100
    for path, value in here.items():
        assert there[path] == pytest.approx(value, rel=1e-9, abs=1e-12), path


def test_concurrent_runs_in_process_equal_one_run_at_a_time(fixture_path):
    """Two probe windows, and two chunks of an evaluation window's loss runs, at a time on one session's threads
    give the numbers of one run at a time."""
    settings = DiagnoseSettings(DataSettings(seq_len=32), windows=3, eval_windows=1, only=("deficit", "diversity", "defect", "gate", "ablation"))
    options = runtime.analysis(runtime.Options(threads=1))
    here = dict(_leaves(_diagnose(fixture_path("llama"), settings, options).to_json()))
    with cluster.pool(concurrent=2) as pool:
        assert pool.parallel == 2
        there = dict(_leaves(_diagnose(fixture_path("llama"), settings, options, pool).to_json()))
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
    assert said(quiet.stderr) == [] and (tmp_path / "q" / "report.json").exists()


@pytest.mark.slow
def test_auto_selection_on_ray_actors_equals_the_in_process_run(fixture_path, tmp_path):
    pytest.importorskip("ray")
    from threadpoolctl import threadpool_limits

    from surgery.jobs import job, select, trials

    settings = JobSettings(DataSettings(seq_len=32), FitSettings(windows=4), select.SelectionSettings(select.Budget(None, 1.0), windows=8),
                           eval_windows=2, latency=LatencySettings(measure=False))
    with threadpool_limits(1), pytest.MonkeyPatch.context() as patch:  # one BLAS thread, as each actor has: the fit's float32 products then sum in the same order
        patch.setattr(trials.resumable, "resumable", lambda board, blocks: None)  # whole passes, as on Ray (resumed ones: test_select)
        here, _ = job.auto(fixture_path("llama"), tmp_path / "here", dataclasses.replace(settings, resources=Resources(runtime.Options(threads=1))))
    there, _ = job.auto(fixture_path("llama"), tmp_path / "there", dataclasses.replace(settings, resources=Resources(workers=2)))
    assert there.selection.layers == here.selection.layers and len(here.selection.trials) >= 3
    for a, b in zip(here.selection.trials, there.selection.trials):
        assert (a.layer, a.form, a.kept) == (b.layer, b.form, b.kept)
        assert b.dnll == pytest.approx(a.dnll, rel=1e-9, abs=1e-12)
        assert b.kl == pytest.approx(a.kl, rel=1e-9, abs=1e-12)  # the reference log-probs travel to the actors
    assert there.selection.c_comp == pytest.approx(here.selection.c_comp, rel=1e-9)  # the fit ran on the actors too


def _fit_numbers(fits: dict) -> dict:
    out = {}
    for layer, r in fits.items():
        out[layer] = [r.ridge, r.residual, r.c_comp, *r.scores.values()]
        out[layer] += [np.asarray(part, np.float64) for part in (r.fix.w_a, r.fix.w_p, r.fix.b, r.fix.w_in, r.fix.b_in)]
    return out


def test_fit_on_a_local_2_cpu_ray_cluster_equals_the_in_process_fit(fixture_path):
    """Each actor sums the normal equations of one contiguous run of windows; the driver adds them in window order.
    Two actors' sums take three times one pass's memory on this machine, so a bound of three layers' sums makes
    one pass in process and three on the local cluster: the passes are counted with the actors' copies. The input
    side runs on 5 of the 7 windows, split between the actors as the output side's 7 are."""
    pytest.importorskip("ray")
    from surgery import compensation
    from surgery.compensation.equations import NormalEquations
    from surgery.files import graph
    from surgery.model.embedding import embedding_table
    from surgery.text import data

    path = fixture_path("llama")
    model = graph.load(path)
    windows = data.windows(path, seq_len=16, max_windows=7, part="calibration")  # 7: the actors' runs differ in length
    bound = 3 * NormalEquations.nbytes(embedding_table(model)[1])
    here = compensation.fit(model, windows, settings=FitSettings(memory=bound, input_windows=5))
    with cluster.pool(workers=2) as pool:
        # each chunk: the input side's pass and the output side's
        assert (pool.copies, compensation.fit_passes(model, settings=FitSettings(memory=bound), pool=pool),
                compensation.fit_passes(model, settings=FitSettings(memory=bound))) == (3, 6, 2)
        done = []
        there = compensation.fit(model, windows, settings=FitSettings(memory=bound, input_windows=5), pool=pool,
                                 progress=lambda d, t: done.append((d, t)))
    assert done[-1] == (3 * len(windows) + 3 * 5,) * 2
    a, b = _fit_numbers(here), _fit_numbers(there)
    assert a.keys() == b.keys() == {0, 1, 2}
    for layer in a:  # one graph here, three there: ORT fuses their ln2 copies differently, a few float32 ulps apart
        for x, y in zip(a[layer], b[layer]):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5 * np.abs(x).max(), err_msg=f"block {layer}")


def test_gpu_share_of_each_actor():
    assert cluster._gpu_share("cpu", 8, 2) == 0 and cluster._gpu_share("auto", 0, 2) == 0
    assert cluster._gpu_share("auto", 2, 4) == 0.5 and cluster._gpu_share("cuda", 8, 2) == 1.0
    with pytest.raises(SurgeryError, match="^--device cuda: the Ray cluster has no GPU"):
        cluster._gpu_share("cuda", 0, 2)


def test_cuda_actors_that_cannot_run_on_cuda_fail_in_one_line(fixture_path, tmp_path):
    """A local cluster declaring two GPUs that this machine does not have: each actor gets one (num_gpus) and runs
    with --device cuda, and its session cannot start there; a cluster with no GPU at all fails before any actor starts."""
    pytest.importorskip("ray")
    from surgery import compensation
    from surgery.files import graph
    from surgery.text import data

    path = fixture_path("llama")
    model = graph.load(path)
    windows = data.windows(path, seq_len=16, max_windows=2, part="calibration")
    if runtime.cuda_usable():
        pytest.skip("CUDA works here: the actors would run")
    with cluster.pool(workers=2, gpus=2, device="cuda") as pool:
        assert pool.gpus == 1.0 and pool.options(runtime.Options()).device == "cuda"
        with pytest.raises(SurgeryError) as error:
            compensation.fit(model, windows, pool=pool)
    message = str(error.value)
    assert message.startswith("on the Ray worker at ") and "CUDA is not usable" in message and "\n" not in message
    with pytest.raises(SurgeryError, match="no GPU"), cluster.pool(workers=2, gpus=0, device="cuda"):
        pass
    result = CliRunner().invoke(app, ["parallelize", str(path), "-o", str(tmp_path / "out"), "--workers", "2", "--device", "cuda"])
    assert result.exit_code == 1 and len(said(result.output)) == 1 and not (tmp_path / "out").exists()
