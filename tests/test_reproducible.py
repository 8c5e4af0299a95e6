"""Same command, same result: the main job on 1 and on 2 ONNX Runtime threads writes the same numbers and the same
model, and a log (stderr that is not a terminal) shows its progress stage by stage."""

import json
import os
import shutil
import time

from surgery.report.log import Log
from tests.test_checkpoint import JOB, _cli, _numbers


def test_the_main_job_on_one_thread_and_on_two_writes_the_same_selection_and_the_same_model(fixture_path, tmp_path):
    runs = {}
    for threads in ("1", "2"):
        out = tmp_path / f"threads-{threads}"
        # one thread on one core (taskset, where there is one), so that BLAS, too, runs one thread: the fixes' sums and folds must not move
        pin = ["taskset", "-c", "0"] if threads == "1" and shutil.which("taskset") and len(os.sched_getaffinity(0)) > 1 else []
        done = _cli(["parallelize", str(fixture_path("llama")), "-o", str(out), *JOB, "--threads", threads], prefix=pin)
        assert done.returncode == 0, done.stderr
        runs[threads] = (out, done.stderr)
    (one, log), (two, _) = runs["1"], runs["2"]
    mine, theirs = (dict(_numbers(json.loads((o / "selection.json").read_text()))) for o in (one, two))
    assert mine.keys() == theirs.keys() and len(mine) > 100
    assert mine == theirs  # timings and the memory bound aside (test_checkpoint.TIMES)
    assert (one / "model.onnx").read_bytes() == (two / "model.onnx").read_bytes()
    windows = json.loads((one / "selection.json").read_text())["windows"]
    assert {w["ids_digest"] for w in windows.values()} == {w["ids_digest"] for w in json.loads((two / "selection.json").read_text())["windows"].values()}
    # stderr was a pipe: a line when each stage starts and when it ends, no progress bar
    for stage in ("the model's samples (8 calibration windows)", "fit (2 passes)", "greedy selection", "evaluation windows"):
        assert f"{stage}: started (" in log and f"{stage}: done in " in log, (stage, log)
    assert "\r" not in log and "\x1b[" not in log


def test_a_log_gets_a_line_per_stage_and_one_every_interval_inside_it_and_between_stages():
    lines, now = [], [0.0]
    log = Log(lines.append, every=10, clock=lambda: now[0])
    now[0] = 12
    log.beat()  # nothing reported yet
    log("fit", 0, 10)
    now[0] = 17
    log("fit", 1, 10)  # within the interval: nothing
    now[0] = 24
    log("fit", 2, 10)
    now[0] = 42
    log.beat()  # the heartbeat: no count for 18 s
    now[0] = 47
    log.beat()  # 5 s after the last line: nothing
    now[0] = 52
    log("fit", 10, 10)
    now[0] = 70
    log.beat()  # between stages
    log("trials", 0, 3)
    assert lines == ["still working after 12 s (no step has reported yet)", "fit: started (10 steps)",
                     "fit: 2/10 (20 %) after 12 s, about 48 s left", "fit: 2/10 (20 %) after 30 s, about 2 min 0 s left",
                     "fit: done in 40 s", "still working after 70 s (fit ended 18 s ago)", "trials: started (3 steps)"]


def test_the_heartbeat_thread_writes_while_a_stage_reports_nothing():
    lines = []
    with Log(lines.append, every=0.05) as log:
        log("one long step", 0, 1)
        time.sleep(1.3)
    assert lines[0] == "one long step: started (1 steps)" and len(lines) >= 2 and lines[1].startswith("one long step: 0/1 (0 %) after ")
