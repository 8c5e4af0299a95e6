"""The pass contract, for every registered pass and for one defined here as a pass module would define it (attention
scaled by a constant): pure, idempotent, its history and node tags, its switch equal to the written form, and
`inspect` showing it. A new pass module gets all of it with no edit here or anywhere else."""

import json

import numpy as np
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

from surgery.analysis.switchboard import SWITCHES, Switch, switchboard, switches
from surgery.cli import app
from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import graph, metadata
from surgery.model.nodes import Emitter
from surgery.model.subject import Subject
from surgery.passes import PASSES, Change, Pass, ablate, apply_pass, register
from surgery.passes.common import float_dtype, node_name

# ---- the pass module: surgery/passes/scale_attn.py would hold exactly this (and `register(ScaleAttn())`) ----
NAME = "scale_attn"


class ScaleAttn(Pass):
    """The residual add receives factor * attn_out."""

    name = NAME
    Args = float

    def done(self, subject, block, factor):
        producer = subject.values[block.attn_out].producer()  # after the rewrite, attn_out is what the residual add reads
        return "already scaled" if producer is not None and metadata.made_by(producer) == NAME else None

    def apply(self, subject, block, factor) -> Change:
        out = subject.values[block.attn_out]
        built: list[ir.Node] = []
        e = Emitter(node_name(NAME, block.layer, "attn_out"), nodes=built)
        scaled = e.op("Mul", [out, e.const("factor", np.array(factor, float_dtype(subject.model, out, subject.stream)))], "scaled")
        subject.graph.insert_after(out.producer(), built)
        for user, i in list(out.uses()):
            if user.op_type == "Add" and user not in built:
                user.replace_input_with(i, scaled)
        return Change(block.layer, f"attn_out x {factor:g}")

    def switch(self, board, block, on, factor) -> None:
        built: list[ir.Node] = []
        e = Emitter(board.prefix, nodes=built)
        scaled = e.op("Mul", [board.values[block.attn_out], e.const("factor", np.array(factor, board.dtype))], "scaled")
        board.choose(block, "attn", on, built, scaled, f"{board.prefix}/chosen")

    def options(self, factor, layers) -> dict:
        return {"factor": factor}

    def example(self, subject, layers) -> float:
        return 0.5


# ---- end of the pass module ----

OURS = ScaleAttn()
CONTRACT = sorted({*PASSES, NAME})
LAYERS = [1, 2]


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setitem(PASSES, NAME, OURS)  # what `register(ScaleAttn())` does at import, undone after the test


@pytest.fixture
def model(fixture_path):
    return graph.load(fixture_path("llama"))


def _logits(model, ids, extra=None):
    sess = runtime.session(model)
    return sess.run(["logits"], runtime.feeds(sess, ids, extra=extra))[0]


def _written(model, name):
    p = PASSES[name]
    args = p.example(Subject.of(model), LAYERS)
    return p, args, apply_pass(model, p, LAYERS, args)


def _nodes(model):
    return [(n.name, n.op_type, tuple(v.name if v is not None else None for v in n.inputs)) for n in model.graph]


@pytest.mark.parametrize("name", CONTRACT)
def test_a_pass_is_pure_and_idempotent(model, name):
    before = ir.serde.serialize_model(model).SerializeToString()
    p, args, result = _written(model, name)
    assert ir.serde.serialize_model(model).SerializeToString() == before  # the input is not modified
    assert result.changed_layers == tuple(LAYERS)
    again = apply_pass(result.model, p, LAYERS, args)
    assert again.changed_layers == () and [c.layer for c in again.changes] == LAYERS
    assert _nodes(again.model) == _nodes(result.model)
    assert metadata.history(again.model) == metadata.history(result.model)


@pytest.mark.parametrize("name", CONTRACT)
def test_a_pass_records_its_history_and_tags_its_nodes(model, name):
    p, _, result = _written(model, name)
    history = metadata.history(result.model)
    assert [e["pass"] for e in history] == [*p.before, name]
    assert all(e["layers"] == LAYERS for e in history)
    old = {n.name for n in model.graph}
    new = [n for n in result.model.graph if n.name not in old]
    assert new, "the rewrite adds nodes"
    for node in new:  # every new node says which pass made it, and for which of the chosen blocks
        assert metadata.made_by(node) in (*p.before, name), node.name
        assert int(node.metadata_props[metadata.LAYER]) in LAYERS
    assert any(n.name.startswith(f"surgery/{name}/blocks.") for n in new)


@pytest.mark.parametrize("name", CONTRACT)
def test_a_switch_equals_the_written_form(model, name):
    p, args, result = _written(model, name)
    ids = np.random.default_rng(0).integers(0, 512, size=(1, 12))
    written, original = _logits(result.model, ids), _logits(model, ids)
    assert np.abs(written - original).max() > 1e-3  # the edit changes the logits: the comparison can fail
    kinds = [Switch(b) for b in p.before] + [Switch(name, args)]
    if p.switch is None:
        with pytest.raises(SurgeryError, match=f"no pass offers a switch '{name}'; the switchable passes are"):
            switchboard(model, kinds)
        return
    board = switchboard(model, kinds)
    n = Subject.of(model).n_layers
    for on, want in (({}, original), ({kind: set(LAYERS) for kind in kinds}, written)):
        got = _logits(board, ids, extra={SWITCHES: switches(kinds, n, on)})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CONTRACT)
def test_inspect_shows_a_pass(model, name, tmp_path):
    _, _, result = _written(model, name)
    out = tmp_path / "rewritten.onnx"
    graph.save(result.model, out)
    shown = json.loads(CliRunner().invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert name in [e["pass"] for e in shown["history"]]


def test_the_pass_defined_here_equals_the_built_in_scaling(model):
    ids = np.random.default_rng(1).integers(0, 512, size=(1, 12))
    expected = _logits(ablate(model, "attn", "scale", LAYERS, scale=0.5).model, ids)  # checked against HF hooks in test_passes
    np.testing.assert_allclose(_logits(apply_pass(model, NAME, LAYERS, 0.5).model, ids), expected, rtol=1e-5, atol=1e-5)


def test_an_unknown_pass_is_one_line(model):
    with pytest.raises(SurgeryError, match="no pass named 'nope'; the passes are ablate, compensate, fuse"):
        apply_pass(model, "nope", [0])


def test_register_makes_a_pass_known(monkeypatch):
    monkeypatch.delitem(PASSES, NAME)
    assert register(OURS) is OURS and PASSES[NAME] is OURS
