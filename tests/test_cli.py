import json

import pytest
from typer.testing import CliRunner

from surgery.cli import app
from tests.test_blocks import _linear_model

runner = CliRunner()


def test_inspect_shows_every_block_and_the_kv_cache(fixture_path):
    result = runner.invoke(app, ["inspect", str(fixture_path("llama"))])
    assert result.exit_code == 0, result.output
    assert "3 sequential" in result.stdout
    assert "KV cache  yes: 6 past inputs" in result.stdout
    assert "RMSNorm (decomposed)" in result.stdout


def test_inspect_json_is_the_block_map(fixture_path):
    result = runner.invoke(app, ["inspect", str(fixture_path("gpt_neox_parallel")), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["n_layers"] == 3 and facts["form"] == "parallel" and facts["kv_cache"] is True
    assert facts["d_model"] == 64 and facts["vocab"] == 512
    assert [b["resid_mid"] for b in facts["blocks"]] == [None, None, None]
    assert [b["form"] for b in facts["blocks"]] == ["parallel"] * 3


def _bad_inputs(tmp_path, fixture_path):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes((fixture_path("llama") / "model.onnx").read_bytes()[:5000])
    no_blocks = tmp_path / "linear.onnx"
    import onnx_ir as ir

    ir.save(_linear_model(), no_blocks)
    return {
        "text": (text, "cannot read"),
        "truncated": (truncated, "cannot read"),
        "no blocks": (no_blocks, "found no transformer blocks"),
        "missing": (tmp_path / "nowhere.onnx", "does not exist"),
        "empty folder": (tmp_path, "found no .onnx file"),
    }


@pytest.mark.parametrize("case", ["text", "truncated", "no blocks", "missing", "empty folder"])
def test_inspect_bad_input_is_one_line_and_exit_1(tmp_path, fixture_path, case):
    (tmp_path / "in").mkdir()
    path, message = _bad_inputs(tmp_path / "in", fixture_path)[case]
    if case == "empty folder":
        path = tmp_path / "empty"
        path.mkdir()
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output and result.stdout == ""
