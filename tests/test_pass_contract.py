"""A new pass is one module: this file writes one (attention scaled by a constant) as a pass module would, and
the switchboard, the history and `inspect` take it with no edit anywhere else in surgery."""

import json

import numpy as np
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

from surgery import graph, metadata, runtime
from surgery.analysis import switchboard as board_graph
from surgery.blocks import find_blocks
from surgery.cli import app
from surgery.metadata import tag
from surgery.nodes import Emitter, values_by_name
from surgery.passes import PASSES, Change, Pass, SurgeryResult, ablate
from surgery.passes.common import check_layers, float_dtype, node_name, record

# ---- the pass module: surgery/passes/scale_attn.py would hold exactly this ----
NAME = "scale_attn"


def scale_attn(model: ir.Model, layers, factor: float = 0.5) -> SurgeryResult:
    """The residual add receives factor * attn_out."""
    model = model.clone()
    blocks = find_blocks(model)
    values = values_by_name(model)
    changes = []
    for layer in sorted(check_layers(layers, blocks)):
        out = values[blocks[layer].attn_out]
        built: list[ir.Node] = []
        e = Emitter(node_name(NAME, layer, "attn_out"), nodes=built)
        scaled = e.op("Mul", [out, e.const("factor", np.array(factor, float_dtype(model, out)))], "scaled")
        model.graph.insert_after(out.producer(), built)
        for user, i in list(out.uses()):
            if user.op_type == "Add" and user not in built:
                user.replace_input_with(i, scaled)
        for node in built:
            tag(node, NAME, layer)
        changes.append(Change(layer, f"attn_out x {factor:g}"))
    result = SurgeryResult(model, tuple(changes))
    record(model, NAME, result.changed_layers, {"factor": factor})
    return result


def switch(board, block, on, prefix, factor: str) -> None:
    """In a switchboard: the residual add receives factor * attn_out while `on`."""
    built: list[ir.Node] = []
    e = Emitter(prefix, nodes=built)
    scaled = e.op("Mul", [board.values[block.attn_out], e.const("factor", np.array(float(factor), board.dtype))], "scaled")
    board.choose(block, "attn", on, built, scaled, f"{prefix}/chosen")


PASS = Pass(NAME, scale_attn, switch)
# ---- end of the pass module ----


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(PASSES, NAME, PASS)  # what `register(PASS)` does at import, undone after the test


def _logits(model, ids, extra=None):
    sess = runtime.session(model)
    return sess.run(["logits"], runtime.feeds(sess, ids, extra=extra))[0]


def test_a_pass_defined_outside_surgery_is_switchable_and_written(registered, fixture_path, tmp_path):
    path = fixture_path("llama")
    model = graph.load(path)
    ids = np.random.default_rng(0).integers(0, 512, size=(1, 12))
    written = PASSES[NAME].apply(model, [1], factor=0.5).model
    expected = _logits(ablate(model, "attn", "scale", [1], scale=0.5).model, ids)  # the built-in pass, checked against HF hooks
    np.testing.assert_allclose(_logits(written, ids), expected, rtol=1e-5, atol=1e-5)
    assert np.abs(expected - _logits(model, ids)).max() > 1e-3  # the edit changes the logits: the comparison can fail

    kinds = [("parallelize",), (NAME, "0.5")]
    board = board_graph.switchboard(model, kinds)
    n = len(find_blocks(model))
    for on, want in (({}, _logits(model, ids)), ({kinds[1]: {1}}, expected)):
        got = _logits(board, ids, extra={board_graph.SWITCHES: board_graph.switches(kinds, n, on)})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    out = tmp_path / "scaled.onnx"
    graph.save(written, out)
    assert metadata.history(graph.load(out))[-1] == {**metadata.history(written)[-1], "pass": NAME, "layers": [1]}
    shown = json.loads(CliRunner().invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert NAME in json.dumps(shown)


def test_a_kind_no_pass_offers_is_one_line(fixture_path):
    from surgery.errors import SurgeryError

    with pytest.raises(SurgeryError, match="no pass offers a switch \\('scale_attn', '0.5'\\); the switchable passes are"):
        board_graph.switchboard(graph.load(fixture_path("llama")), [(NAME, "0.5")])
