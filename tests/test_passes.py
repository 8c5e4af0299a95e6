import numpy as np
import onnx_ir as ir
import pytest

from surgery.analysis import probe as probe_graph
from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import graph, metadata
from surgery.model.blocks import find_blocks
from surgery.model.embedding import stream_dtype
from surgery.passes import MODES, ablate, parallelize

torch = pytest.importorskip("torch")
from tests.helpers import FAMILIES, IDS, Exported, assert_logits_equal, logits  # noqa: E402
from tests.reference import edited_logits  # noqa: E402

COVERED = ["gpt2", "gpt_neox", "gpt_neox_parallel", "llama", "qwen2", "gemma2", "olmo2"]
LAYER_SETS = [{1}, {0, 2}, {0, 1, 2}]


@pytest.fixture(scope="module", params=COVERED)
def tiny(request, tiny_export):
    """A tiny random model (seed 5) and its optimum export with a KV cache."""
    return Exported(tiny_export(request.param, seed=5))


@pytest.mark.parametrize("layers", LAYER_SETS, ids=str)
def test_parallelize_matches_the_hooked_hf_model(tiny, layers):
    result = parallelize(tiny.onnx, layers)
    assert_logits_equal(result.model, tiny.reference(parallel=layers))
    assert all(find_blocks(result.model)[layer].is_parallel for layer in layers)
    sequential = not tiny.torch.config.to_dict().get("use_parallel_residual", False)
    assert result.changed_layers == (tuple(sorted(layers)) if sequential else ())
    assert [c.what for c in result.changes] == ["ln2 reads resid_pre" if sequential else "already parallel"] * len(layers)


@pytest.mark.parametrize("layers", LAYER_SETS, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("branch", ["mlp", "attn"])
def test_ablate_matches_the_hooked_hf_model(tiny, branch, mode, layers):
    scale = 0.5 if mode == "scale" else None
    result = ablate(tiny.onnx, branch, mode, layers, scale)
    expected = tiny.reference(branch_edits=[(branch, mode, layers, scale)])
    assert_logits_equal(result.model, expected)
    assert result.changed_layers == tuple(sorted(layers))


@pytest.mark.parametrize("mode", ["tangential", "radial", "remove"])
@pytest.mark.parametrize("branch", ["mlp", "attn"])
def test_keep_sink_matches_the_hooked_hf_model_that_skips_position_0(tiny, branch, mode):
    kept = ablate(tiny.onnx, branch, mode, {0, 1, 2}, keep_sink=True).model
    expected = edited_logits(tiny.torch, IDS, branch_edits=[(branch, mode, {0, 1, 2}, None)], keep_sink=True)
    assert_logits_equal(kept, expected)
    everywhere = logits(ablate(tiny.onnx, branch, mode, {0, 1, 2}).model)
    assert np.abs(everywhere - expected).max() > 1e-3  # position 0 really kept its output
    assert ablate(kept, branch, mode, {0, 1, 2}, keep_sink=True).changed_layers == ()


def test_keep_sink_in_a_kv_cache_decode_ablates_every_new_token(tiny):
    """After a cache, no token is at position 0: the decode step equals the full keep-sink pass's last token."""
    model = ablate(tiny.onnx, "mlp", "tangential", {0, 1, 2}, keep_sink=True).model
    session = runtime.session(model)
    full = session.run(["logits"], runtime.feeds(session, IDS))[0]
    prefill = session.run(None, runtime.feeds(session, IDS[:, :-1]))
    past = runtime.present_as_past(session, prefill)
    step = session.run(["logits"], runtime.feeds(session, IDS[:, -1:], past))[0]
    np.testing.assert_allclose(step[:, 0], full[:, -1], rtol=1e-4, atol=1e-4)


def test_passes_compose_like_hooks(tiny):
    edits = [("mlp", "tangential", {0, 1, 2}, None), ("attn", "scale", {1}, 0.25)]
    model = parallelize(tiny.onnx, {0, 2}).model
    for branch, mode, layers, scale in edits:
        model = ablate(model, branch, mode, layers, scale).model
    assert_logits_equal(model, tiny.reference({0, 2}, edits))
    assert [h["pass"] for h in metadata.history(model)] == ["parallelize", "ablate", "ablate"][
        1 if tiny.torch.config.to_dict().get("use_parallel_residual") else 0 :
    ]


def _proto(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString()


@pytest.mark.parametrize(
    "apply",
    [
        lambda m, layers: parallelize(m, layers),
        lambda m, layers: ablate(m, "mlp", "tangential", layers),
        lambda m, layers: ablate(m, "attn", "scale", layers, 0.5),
        lambda m, layers: ablate(m, "mlp", "remove", layers),
    ],
    ids=["parallelize", "mlp-tangential", "attn-scale", "mlp-remove"],
)
def test_pure_idempotent_and_empty_is_identity(tiny, apply):
    before = _proto(tiny.onnx)
    original = logits(tiny.onnx)

    empty = apply(tiny.onnx, set())
    assert empty.changes == () and metadata.history(empty.model) == []
    np.testing.assert_array_equal(logits(empty.model), original)  # bit-identical

    once = apply(tiny.onnx, {0, 2})
    twice = apply(once.model, {0, 2})
    assert twice.changed_layers == ()
    assert _proto(twice.model) == _proto(once.model)
    np.testing.assert_array_equal(logits(twice.model), logits(once.model))
    assert _proto(tiny.onnx) == before  # the input model is untouched


def test_new_nodes_are_named_and_tagged(tiny):
    model = ablate(tiny.onnx, "mlp", "radial", {1}).model
    new = [n for n in model.graph if n.name.startswith("surgery/ablate/blocks.1/")]
    assert new and all(n.metadata_props["surgery.pass"] == "ablate" for n in new)
    assert all(n.metadata_props["surgery.layer"] == "1" for n in new)
    assert find_blocks(model)[1].mlp_out == "surgery/ablate/blocks.1/mlp_out_radial"
    entry = metadata.history(model)[-1]
    assert entry["pass"] == "ablate" and entry["layers"] == [1] and entry["options"]["mode"] == "radial"


def test_dynamo_graphs_take_the_same_passes(tiny_export):
    tiny = Exported(tiny_export("llama", exporter="dynamo", past=False, seed=5))
    model = ablate(parallelize(tiny.onnx, {1}).model, "mlp", "tangential", {0, 2}).model
    expected = tiny.reference({1}, [("mlp", "tangential", {0, 2}, None)])
    assert_logits_equal(model, expected)
    assert "position_ids" not in {v.name for v in tiny.onnx.graph.inputs}  # position 0 is then token 0
    kept = ablate(tiny.onnx, "attn", "radial", {0, 1, 2}, keep_sink=True).model
    expected = edited_logits(tiny.torch, IDS, branch_edits=[("attn", "radial", {0, 1, 2}, None)], keep_sink=True)
    assert_logits_equal(kept, expected)


def test_rewritten_kv_cache_folder_generates_like_the_hooked_model(tmp_path, tiny_export):
    from optimum.onnxruntime import ORTModelForCausalLM

    from tests.reference import Edits

    tiny = Exported(tiny_export("llama", seed=5))
    model = ablate(parallelize(tiny.onnx, {0, 2}).model, "mlp", "tangential", {1}).model
    out = graph.write(model, tmp_path / "rewritten", like=tiny.folder)
    prompt = torch.from_numpy(IDS[:1, :5])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = ORTModelForCausalLM.from_pretrained(out.parent).generate(prompt, **kwargs)
    with Edits(tiny.torch, {0, 2}, [("mlp", "tangential", {1}, None)]), torch.no_grad():
        expected = tiny.torch.generate(prompt, **kwargs)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_bad_pass_options_are_one_clear_error(fixture_path):
    model = graph.load(fixture_path("llama"))
    with pytest.raises(SurgeryError, match="needs a factor"):
        ablate(model, "mlp", "scale", {0})
    with pytest.raises(SurgeryError, match="unknown branch"):
        ablate(model, "ffn", "radial", {0})
    for factor in (float("nan"), float("inf")):  # a graph of NaN would be written without a word
        with pytest.raises(SurgeryError, match="give a finite factor"):
            ablate(model, "mlp", "scale", {0}, scale=factor)
    with pytest.raises(SurgeryError, match="out of range"):
        parallelize(model, {3})


def test_normalised_branch_outputs_are_found_and_refuse_folding(tiny):
    from surgery.passes import Fix, compensate, fuse

    blocks = find_blocks(tiny.onnx)
    normalised = FAMILIES[tiny.torch.config.model_type].post_norm
    assert all(b.post_norm == normalised for b in blocks)
    if not normalised:
        return
    d = tiny.torch.config.hidden_size
    fix = Fix(np.zeros((d, d)), np.zeros((d, d)), np.zeros(d))
    for rewrite in (lambda: fuse(tiny.onnx, {1}), lambda: compensate(tiny.onnx, {1: fix})):
        with pytest.raises(SurgeryError, match="block 1: it normalises its branch outputs"):
            rewrite()


def test_fuse_refuses_an_rmsnorm_whose_epsilon_it_cannot_read(fixture_path):
    """A decomposed RMSNorm whose epsilon is computed, not a constant: --fuse says so instead of assuming one."""
    from surgery.model.blocks import block_norms
    from surgery.passes import fuse

    model = graph.load(fixture_path("llama"))
    block = find_blocks(model)[1]
    ln1, _ = block_norms(model, block)
    assert ln1.eps == pytest.approx(1e-6)  # what the export's constant says
    add = next(n for n in model.graph if n.op_type == "Add" and n.name == "/model/layers.1/input_layernorm/Add")
    assert add.inputs[0].producer().op_type == "ReduceMean"
    eps_index = 1
    computed = ir.node("Abs", [add.inputs[eps_index]])  # the same number, no longer a constant
    model.graph.insert_before(add, computed)
    add.replace_input_with(eps_index, computed.outputs[0])
    assert block_norms(model, block)[0].eps is None
    with pytest.raises(SurgeryError, match="cannot fuse block 1: the normalisations' epsilon is not one constant"):
        fuse(model, {1})
    fuse(model, {0})  # the other blocks still fuse


def test_the_stream_dtype_comes_from_the_graph_or_the_tap_fails(fixture_path):
    model = graph.load(fixture_path("llama"))
    assert stream_dtype(model) == ir.DataType.FLOAT
    untyped = next(v.name for n in model.graph for v in n.outputs if v.dtype is None)
    table = next(n for n in model.graph if n.op_type == "Gather" and n.inputs[0].is_initializer())
    table.inputs[0].dtype = None  # nothing in the graph says what the stream is any more
    with pytest.raises(SurgeryError, match="cannot tell the residual stream's float type"):
        probe_graph.tap(model, [untyped])
