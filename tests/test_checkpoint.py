"""Checkpoints: a main job killed (SIGKILL) during the fit or the selection resumes to the uninterrupted output; a
work folder of other inputs or options is refused; a Ray actor killed mid-fit or mid-trials is replaced and its job
redone."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from surgery.compensation.equations import FitResult, NormalEquations
from surgery.compensation.fitting import FitSettings
from surgery.engine.cluster import Resources
from surgery.errors import SurgeryError
from surgery.files import checkpoint
from surgery.files.checkpoint import TYPES, Checkpoints, checkpointable, work_folder
from surgery.jobs import job, select
from surgery.jobs.job import JobSettings
from surgery.measure import statistics
from surgery.measure.timing import LatencySettings
from surgery.passes import Fix
from surgery.text.data import DataSettings
from tests.helpers import said

TIMES = {"seconds", "fit_seconds", "latency", "fit_memory", "estimated_speedup", "resumed", "checkpoints"}  # measured, not computed
JOB = ["--seq-len", "32", "--fit-windows", "8", "--windows", "8", "--eval-windows", "2", "--no-latency", "--max-kl", "none",
       "--max-loss-increase", "1"]


def _numbers(report, path=""):
    """(path, value) of every leaf of selection.json but the timings and what depends on the machine's state."""
    if isinstance(report, dict):
        for key, value in report.items():
            if key not in TIMES:
                yield from _numbers(value, f"{path}/{key}")
    elif isinstance(report, list):
        for i, value in enumerate(report):
            yield from _numbers(value, f"{path}/{i}")
    else:
        yield path, report


def _cli(args, env=None, wait=True, prefix=()):
    command = [*prefix, sys.executable, "-m", "surgery.cli", *args]
    environ = {**os.environ, "SURGERY_CHECKPOINT_SECONDS": "0", **(env or {})}  # a snapshot after every window
    if wait:
        return subprocess.run(command, capture_output=True, text=True, env=environ)
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environ)


def _killed_at(unit: str, args: list[str], pause: Path, skip: int = 0) -> None:
    """Run the main job until it reaches `unit` the (skip + 1)th time, SIGKILL it there."""
    run = _cli(args, {"SURGERY_PAUSE_AT": unit, "SURGERY_PAUSE_FILE": str(pause), "SURGERY_PAUSE_SKIP": str(skip)}, wait=False)
    deadline = time.monotonic() + 120
    while not pause.exists() or not pause.read_text():
        assert run.poll() is None, f"the job ended before reaching {unit}: {run.stderr.read()}"
        assert time.monotonic() < deadline, f"never reached {unit}"
        time.sleep(0.05)
    pid = int(pause.read_text().split()[0])
    assert pid == run.pid
    os.kill(pid, signal.SIGKILL)
    run.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The output of the main job run through, by its extra options."""
    from tests.helpers import FAMILIES

    outs = {}

    def run(extra: tuple[str, ...]) -> Path:
        if extra not in outs:
            outs[extra] = tmp_path_factory.mktemp("whole") / "out"
            done = _cli(["parallelize", str(FAMILIES["llama"].folder), "-o", str(outs[extra]), *JOB, *extra])
            assert done.returncode == 0, done.stderr
            assert not work_folder(outs[extra]).exists()  # a finished run removes its work folder
        return outs[extra]

    return run


@pytest.mark.parametrize("unit, skip, extra", [
    ("fit inputs window 5", 0, ()),
    ("fit outputs window 3", 0, ()),
    ("fit outputs window 3", 1, ("--fit-memory", "1K")),  # one layer per pass: killed in the second, which starts from the stream the first handed on
    ("selection trial-2", 0, ()),
])
def test_a_main_job_killed_mid_run_resumes_to_the_uninterrupted_output(fixture_path, uninterrupted, tmp_path, unit, skip, extra):
    out = tmp_path / "out"
    args = ["parallelize", str(fixture_path("llama")), "-o", str(out), *JOB, *extra]
    _killed_at(unit, args, tmp_path / "pause", skip)
    assert not out.exists()  # nothing partial in the output
    assert (work_folder(out) / "manifest.json").exists()
    resumed = _cli([*args, "--json"])
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["resumed"]["fit"] >= 2 and ("trials" in report["resumed"]) == unit.startswith("selection")
    assert not work_folder(out).exists()
    mine, theirs = (dict(_numbers(json.loads((o / "selection.json").read_text()))) for o in (out, uninterrupted(extra)))
    assert mine.keys() == theirs.keys() and len(mine) > 100
    for path, value in theirs.items():
        assert mine[path] == (pytest.approx(value, rel=1e-9, abs=1e-12) if isinstance(value, float) else value), path
    assert (out / "model.onnx").read_bytes() == (uninterrupted(extra) / "model.onnx").read_bytes()  # the same fixes, bit for bit


def test_a_diagnose_killed_in_its_loss_runs_resumes_to_the_uninterrupted_report(fixture_path, tmp_path):
    args = ["diagnose", str(fixture_path("llama")), "--seq-len", "32", "--windows", "4", "--eval-windows", "3", "--only", "defect,ablation,prefix"]
    whole = _cli([*args, "-o", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr
    _killed_at("diagnose losses window 1", [*args, "-o", str(tmp_path / "out")], tmp_path / "pause")
    assert not (tmp_path / "out").exists() and len(list((work_folder(tmp_path / "out") / "losses").glob("window-*.npz"))) == 2
    resumed = _cli([*args, "-o", str(tmp_path / "out")])
    assert resumed.returncode == 0, resumed.stderr
    mine, theirs = (dict(_numbers(json.loads((tmp_path / o / "report.json").read_text()))) for o in ("out", "whole"))
    assert mine.keys() == theirs.keys() and len(mine) > 100
    for path, value in theirs.items():
        assert mine[path] == (pytest.approx(value, rel=1e-9, abs=1e-12) if isinstance(value, float) else value), path
    assert not work_folder(tmp_path / "out").exists()


def test_a_work_folder_of_other_options_is_refused_in_one_line_and_restart_discards_it(fixture_path, tmp_path):
    out = tmp_path / "out"
    args = ["parallelize", str(fixture_path("llama")), "-o", str(out), *JOB]
    _killed_at("selection trial-1", args, tmp_path / "pause")
    other = _cli([*args, "--max-loss-increase", "0.5", "--fit-windows", "6"])
    assert other.returncode == 1 and not out.exists()
    [line] = said(other.stderr)
    assert line.startswith(f"error: {work_folder(out)} holds the work of a run with another budget, fit windows")
    assert line.endswith("or add --restart to discard it")
    fresh = _cli([*args, "--max-loss-increase", "0.5", "--restart", "--json"])
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["resumed"] == {} and not work_folder(out).exists()
    broken = tmp_path / "broken"
    work_folder(broken).mkdir()
    (work_folder(broken) / "manifest.json").write_text("{")
    refused = _cli(["parallelize", str(fixture_path("llama")), "-o", str(broken), *JOB])
    assert refused.returncode == 1 and said(refused.stderr) == [
        f"error: {work_folder(broken)} is not a work folder this surgery can read; delete it, or add --restart to discard it"]


def test_a_work_folder_in_use_by_another_run_is_refused_and_the_lock_goes_with_its_process(tmp_path):
    work = Checkpoints.open(tmp_path / "out", {"model": "a"})
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from surgery.files.checkpoint import Checkpoints; "
                               f"Checkpoints.open({str(tmp_path / 'other')!r}, {{}}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(SurgeryError, match=r"other.work is in use by another run writing the same output; wait for it to finish, or choose another -o"):
        Checkpoints.open(tmp_path / "other", {}, restart=True)  # not even --restart takes it from a live run
    holder.kill()
    holder.wait()
    Checkpoints.open(tmp_path / "other", {}).close()  # killed: its lock went with it
    with pytest.raises(SurgeryError, match="out.work is in use by another run"):
        Checkpoints.open(tmp_path / "out", {"model": "a"})  # open in this process: refused until closed
    work.finish()
    assert not work_folder(tmp_path / "out").exists()


def test_a_checkpoint_holds_the_fit_and_the_scores_exactly_and_rebuilds_no_other_type(tmp_path):
    rng = np.random.default_rng(0)
    sums = NormalEquations(4)
    sums.update(1, *(rng.standard_normal((5, 4)).astype(np.float32) for _ in range(4)))
    sums.update_inputs({"o_in": rng.standard_normal((5, 3))})
    fit = FitResult(2, Fix(w_a=rng.standard_normal((4, 4)), w_p=0.5, packed=(None, np.arange(6, dtype=np.uint8))), 1e-3, 0.25, 0.01, 10,
                    scores={"c": 0.1, "c_stream": 0.2, "alpha": 1.1})
    score = statistics.Perplexity(2.0, 7.39, 20, 2, 0.5, (1.5, 2.5), (10, 10), (0.1, 0.2), (3, 4), tuple(rng.random(20).tolist()), tuple(range(20)))
    with Checkpoints.open(tmp_path / "out", {"model": "a"}) as work:
        work.save("unit", {"sums": {3: sums}, "fit": fit, "score": score, "rows": [np.ones(2), None, "x"]})
    work = Checkpoints.open(tmp_path / "out", {"model": "a"})  # closed: this process may open it again
    back = work.load("unit")
    for name in ("zz", "zd", "dd", "tokens", "yy"):
        np.testing.assert_array_equal(getattr(back["sums"][3], name), getattr(sums, name))
    np.testing.assert_array_equal(back["sums"][3].grams["o_in"], sums.grams["o_in"])
    assert back["fit"].fix.w_p == 0.5 and back["fit"].fix.packed[0] is None and back["fit"].scores == fit.scores
    np.testing.assert_array_equal(back["fit"].fix.w_a, fit.fix.w_a)
    assert back["score"] == score and back["rows"][1:] == [None, "x"]
    with pytest.raises(TypeError, match="cannot hold"):
        work.save("bad", {"x": object()})
    meta = {"type": ["os", "system"], "fields": {}}  # a planted file may not name any type
    np.savez(work.folder / "planted.npz", meta=np.array(json.dumps(meta)))
    with pytest.raises(SurgeryError, match=r"names the type os.system, which no loaded module registered as checkpointable\); add --restart"):
        work.load("planted")


def test_a_class_that_registers_itself_is_rebuilt_and_files_names_none_of_them(tmp_path):
    """Checkpoints rebuild the classes that registered with @checkpointable where they are defined (the fit's, the
    scores'), so surgery/files/checkpoint.py names no stage above it; an unregistered dataclass is refused."""

    @dataclasses.dataclass(frozen=True)
    class Plain:
        x: int

    Kept = checkpointable(dataclasses.make_dataclass("Kept", [("x", int), ("y", np.ndarray)], frozen=True))
    with Checkpoints.open(tmp_path / "out", {}) as work:
        work.save("kept", Kept(3, np.arange(4)))
        with pytest.raises(TypeError, match="cannot hold"):
            work.save("plain", Plain(1))
        back = work.load("kept")
    assert type(back) is Kept and back.x == 3
    np.testing.assert_array_equal(back.y, np.arange(4))
    registered = {module for module, _ in TYPES}
    assert {"surgery.compensation.equations", "surgery.passes.fix", "surgery.measure.statistics", "surgery.measure.quality"} <= registered


@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time
@pytest.mark.parametrize("unit, skip", [("fit outputs window 5", 0), ("trial batch", 3)])
def test_a_ray_actor_killed_mid_fit_or_mid_trials_is_replaced_and_the_run_equals_the_in_process_one(fixture_path, tmp_path, monkeypatch, unit, skip):
    pytest.importorskip("ray")
    settings = JobSettings(DataSettings(seq_len=32), FitSettings(windows=8), select.SelectionSettings(select.Budget(None, 1.0), windows=8),
                           eval_windows=2, latency=LatencySettings(measure=False), checkpoints=False)
    here, _ = job.auto(fixture_path("llama"), tmp_path / "here", settings)
    pause = tmp_path / "pause"
    monkeypatch.setenv("SURGERY_PAUSE_AT", unit)  # read by the actors, which the local cluster starts with this environment
    monkeypatch.setenv("SURGERY_PAUSE_FILE", str(pause))
    monkeypatch.setenv("SURGERY_PAUSE_SKIP", str(skip))
    killed = []

    def kill():
        while not pause.exists() or not pause.read_text():
            time.sleep(0.05)
        killed.append(int(pause.read_text().split()[0]))
        os.kill(killed[0], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    there, _ = job.auto(fixture_path("llama"), tmp_path / "there", dataclasses.replace(settings, resources=Resources(workers=2)))
    assert killed and killed[0] != os.getpid()  # an actor died, not this process
    assert there.selection.layers == here.selection.layers and len(here.selection.trials) >= 3
    for a, b in zip(here.selection.trials, there.selection.trials):
        assert (a.layer, a.form, a.kept) == (b.layer, b.form, b.kept)
        assert (b.dnll, b.kl) == (pytest.approx(a.dnll, rel=1e-6, abs=1e-9), pytest.approx(a.kl, rel=1e-6, abs=1e-9))
    assert there.selection.c_comp == pytest.approx(here.selection.c_comp, rel=1e-6)


class _Dies:
    def __init__(self, model):
        pass

    def run(self):
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.xdist_group("ray")
def test_a_job_whose_actor_dies_every_time_stops_the_run_in_one_line_naming_host_and_unit(fixture_path):
    pytest.importorskip("ray")
    import socket

    from surgery.engine import cluster
    from surgery.files import graph

    model = graph.load(fixture_path("llama"))
    with cluster.pool(workers=1) as pool, pytest.raises(SurgeryError) as error:
        list(pool.actors(model, _Dies).map("run", [()], unit="fit outputs windows"))
    assert str(error.value) == (f"the Ray worker at {socket.gethostname()} died {cluster.RETRIES + 1} times running fit outputs windows (job 0); "
                                "check that host's memory and logs, and rerun (a main job resumes from its checkpoints)")


def test_snapshots_are_spaced_so_that_writing_them_costs_at_most_one_part_in_ratio(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(checkpoint.time, "perf_counter", lambda: clock[0])
    work = Checkpoints.open(tmp_path / "out", {}, every=10)
    assert not work.due()
    clock[0] += 10
    assert work.due()
    real_save = np.savez

    def slow_save(*args, **kwargs):  # a snapshot that takes 1 s to write
        clock[0] += 1
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint.np, "savez", slow_save)
    work.save("snapshot", {"x": np.zeros(3)})
    clock[0] += 10
    assert not work.due()  # 10 s of work after a 1 s write: not yet
    clock[0] += checkpoint.RATIO - 10
    assert work.due()
    big = int(2 * checkpoint.RATE)  # a snapshot foreseen to take 2 s at the assumed rate: RATIO times that since the last save
    assert not work.due(big)
    clock[0] += checkpoint.RATIO
    assert work.due(big)
    assert NormalEquations(4).nbytes_held == NormalEquations.nbytes(4) + 3 * 16  # the sums, and dd, yy, tokens per fold
    assert not Checkpoints.off().due() and Checkpoints.off().load("snapshot") is None
    assert Checkpoints.open(tmp_path / "every", {}, every=0).due(10**12)  # every 0 (SURGERY_CHECKPOINT_SECONDS=0): always
