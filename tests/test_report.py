"""The main job's selection picture: drawn from selection.json's dict, written with the model, not blank."""

import io
import json

import matplotlib.image
import numpy as np
import onnx_ir as ir
import pytest

from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.jobs.picture import _FORM_COLOR, selection_picture


def sample_outcome() -> dict:
    """A small selection.json: 5 candidate blocks of 6, two kept compensated and one plain, three trials missed the budget."""
    c, c_stream = [0.30, 0.21, 0.15, 0.09, 0.12], [0.010, 0.006, 0.004, 0.002, 0.003]
    c_comp = [0.004, 0.0035, None, 0.0009, 0.0012]  # block 2 has no fix: ranked by C_stream, tried plain
    forms = {"1": "plain", "3": "compensated", "4": "compensated"}
    tried = [(3, "compensated", 0.0009, 0.004, 0.012, True), (4, "compensated", 0.0012, 0.009, 0.021, True),
             (2, "plain", 0.004, 0.025, 0.034, False), (1, "compensated", 0.0035, 0.024, 0.061, False),
             (1, "plain", 0.0035, 0.018, 0.046, True), (0, "compensated", 0.004, 0.031, 0.08, False)]
    trials = [{"layer": l, "form": f, "score": s, "dnll": d, "low": d - 0.004, "high": d + 0.004, "kept": k,
               "kl": kl, "kl_low": kl * 0.9, "kl_high": kl * 1.1, "top1": 0.9} for l, f, s, d, kl, k in tried]
    blocks = [{"layer": l, "form": forms.get(str(l), "sequential"), "c": c[l], "c_stream": c_stream[l], "c_comp": c_comp[l],
               "alpha": 0.9, "fit": None, "trials": [t for t in trials if t["layer"] == l]} for l in range(5)]
    selection = {"layers": [1, 3, 4], "forms": forms, "score": "c_comp", "fit": "full", "base_loss": 5.0,
                 "dnll": {"dnll": 0.018, "low": 0.014, "high": 0.022}, "divergence": {"kl": 0.046, "kl_interval": [0.041, 0.051]},
                 "candidates": 5, "stopped": None, "refit": None, "blocks": blocks, "trials": trials}
    return {"selection": selection, "form": "compensated and plain", "budget": {"max_kl": 0.05, "max_loss_increase": 0.02}}


def pixels(png: bytes) -> np.ndarray:
    """The PNG's RGB pixels, [height, width, 3] in 0..1."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]


def assert_not_blank(png: bytes, min_inked: float = 0.02) -> np.ndarray:
    """More than one colour, and at least `min_inked` of the pixels differ from the most common one (the background)."""
    rgb = pixels(png)
    colours, counts = np.unique(rgb.reshape(-1, 3), axis=0, return_counts=True)
    assert len(colours) > 1, "one colour"
    inked = 1 - counts.max() / counts.sum()
    assert inked >= min_inked, f"only {inked:.1%} of the pixels differ from the background"
    return rgb


def _has_colour(rgb: np.ndarray, hex_colour: str, tolerance: float = 0.03) -> bool:
    target = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return bool((np.abs(rgb - target).max(axis=-1) < tolerance).sum() > 20)


def test_the_selection_picture_draws_both_forms_from_a_saved_selection(tmp_path):
    saved = tmp_path / "selection.json"
    saved.write_text(json.dumps(sample_outcome()))
    rgb = assert_not_blank(selection_picture(json.loads(saved.read_text())))
    assert rgb.shape[0] > 400 and rgb.shape[1] > 400
    assert _has_colour(rgb, _FORM_COLOR["compensated"]) and _has_colour(rgb, _FORM_COLOR["plain"])  # kept trials of each form


def test_a_selection_with_no_trials_or_no_limits_is_still_drawn():
    outcome = sample_outcome()
    outcome["selection"].update(layers=[], forms={}, trials=[], blocks=[], divergence=None, candidates=0)
    assert_not_blank(selection_picture(outcome), min_inked=0.01)
    unlimited = sample_outcome()
    unlimited["budget"] = {"max_kl": None, "max_loss_increase": None}
    assert_not_blank(selection_picture(unlimited))


@pytest.mark.parametrize("shape", ["folder", "file"])
def test_a_picture_is_written_with_the_model_whole_or_not_at_all(tmp_path, fixture_path, monkeypatch, shape):
    like = fixture_path("llama") if shape == "folder" else fixture_path("llama") / "model.onnx"
    out = tmp_path / ("out" if shape == "folder" else "out.onnx")
    png = selection_picture(sample_outcome())
    name = "selection.png" if shape == "folder" else "out.selection.png"
    written = graph.write(graph.load(like), out, like=like, extra={name: png, name.replace(".png", ".json"): "{}"})
    assert (written.parent / name).read_bytes() == png and (written.parent / name.replace(".png", ".json")).read_text() == "{}"

    def fail(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ir, "save", fail)
    with pytest.raises(SurgeryError, match="permission denied"):
        graph.write(graph.load(like), tmp_path / "again" / out.name, like=like, extra={name: png})
    assert not (tmp_path / "again").exists() or not any((tmp_path / "again").iterdir())


def test_the_summary_says_in_words_when_held_out_windows_read_the_choice_over_its_budget(fixture_path, tmp_path):
    """The budget holds on the selection windows' point estimates; where the evaluation windows read the chosen set over
    it, the summary says which limit, by how much, and what to do, and selection.json has the same."""
    import dataclasses

    from surgery.compensation.fitting import FitSettings
    from surgery.jobs import job
    from surgery.jobs.select import Budget, SelectionSettings
    from surgery.measure.statistics import Delta
    from surgery.measure.timing import LatencySettings
    from surgery.report import summary
    from surgery.text.data import DataSettings

    settings = job.JobSettings(DataSettings(seq_len=32), FitSettings(windows=4), SelectionSettings(Budget(None, 1.0), windows=4),
                               eval_windows=2, latency=LatencySettings(measure=False), checkpoints=False)
    outcome, written = job.auto(fixture_path("llama"), tmp_path / "out", settings)
    assert outcome.selection.layers and outcome.over_budget == {}
    assert not any(key == "over budget" for key, _ in summary.lines(outcome, written, outcome.selection.budget, 1))
    tight = Budget(outcome.divergence_eval.kl / 2, 0.1)  # KL below what the evaluation read; dNLL below the one set here
    over = dataclasses.replace(outcome, selection=dataclasses.replace(outcome.selection, budget=tight), dnll_eval=Delta(0.25, 0.2, 0.3))
    assert set(over.over_budget) == {"kl", "dnll"} and over.to_json()["over_budget"]["dnll"] == {"evaluation": 0.25, "limit": 0.1}
    line = dict(summary.lines(over, written, tight, 1))["over budget"]
    assert f"KL {outcome.divergence_eval.kl:.4f} > --max-kl {tight.max_kl:g}" in line and "dNLL +0.2500 > --max-loss-increase 0.1" in line
    assert "selection windows' point estimates" in line and "raise --windows" in line
    below = dataclasses.replace(over, dnll_eval=Delta(0.05, 0.0, 0.1))
    assert set(below.over_budget) == {"kl"}
    # the numbers read as numbers: a KL and a dNLL each beside its interval (report.numbers formats the statistics)
    d = outcome.divergence_eval
    said = dict(summary.lines(over, written, tight, 1))["evaluation"]
    assert said.startswith(f"KL {d.kl:.4f} [{d.low:.4f}, {d.high:.4f}], top-1 {100 * d.top1:.1f} %, dNLL +0.2500 [+0.2000, +0.3000] (")
