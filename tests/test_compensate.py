"""The compensate pass: a given fix (w_a, w_p, b) folded into W_o / W_down equals the hooked HF model
that computes resid_pre + A + P + A w_a + P w_p + b, plain and fused."""

import numpy as np
import onnx_ir as ir
import pytest

from surgery.analysis.fit_graph import kinds, switched
from surgery.errors import SurgeryError
from surgery.files import graph, metadata
from surgery.model.blocks import find_blocks
from surgery.passes import Fix, compensate, fuse, parallelize

torch = pytest.importorskip("torch")

from tests.helpers import FAMILIES, IDS, Exported, assert_logits_equal, logits  # noqa: E402
from tests.reference import edited_logits  # noqa: E402


def planted(d: int, layers, seed: int = 3, inputs: bool = False) -> dict[int, tuple[np.ndarray, ...]]:
    """(w_a, w_p, b) per layer, and with `inputs` (w_in, b_in) too."""
    rng = np.random.default_rng(seed)
    shapes = [(d, d), (d, d), (d,)] + ([(d, d), (d,)] if inputs else [])
    return {l: tuple(0.1 * rng.standard_normal(shape) for shape in shapes) for l in layers}


def as_fix(arrays: tuple[np.ndarray, ...]) -> Fix:
    """Fix(w_a, w_p, b) from planted arrays, with w_in and b_in where they are given."""
    return Fix(*arrays[:3], **dict(zip(("w_in", "b_in"), arrays[3:])))


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2", "gpt_neox"])
def tiny(request, tiny_export):
    """A tiny random model (seed 5) and its optimum export with a KV cache."""
    return Exported(tiny_export(request.param, seed=5))


@pytest.mark.parametrize("inputs", [False, True], ids=["outputs", "with_input_side"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("layers", [{1}, {0, 2}], ids=str)
def test_folded_fix_equals_the_hooked_model(tiny, layers, fused, inputs):
    d = tiny.torch.config.hidden_size
    arrays = planted(d, layers, inputs=inputs)
    fixes = {l: as_fix(a) for l, a in arrays.items()}
    result = fuse(tiny.onnx, layers, fixes) if fused else compensate(tiny.onnx, fixes)
    expected = edited_logits(tiny.torch, IDS, parallel=layers, fixes=arrays)
    assert_logits_equal(result.model, expected)
    # the fix matters: without it the logits are those of the plain parallel model, far from these
    assert np.abs(logits(parallelize(tiny.onnx, layers).model) - expected).max() > 1e-2
    blocks = find_blocks(result.model)
    assert [b.fix for b in blocks] == ["compensated" if b.layer in layers else None for b in blocks]
    assert result.changed_layers == tuple(sorted(layers))


def test_compensate_is_pure_idempotent_and_keeps_the_op_count(tiny):
    d = tiny.torch.config.hidden_size
    fixes = {l: Fix(*a) for l, a in planted(d, {0, 2}).items()}
    before = ir.to_proto(tiny.onnx).SerializeToString()
    once = compensate(tiny.onnx, fixes)
    twice = compensate(once.model, fixes)
    assert twice.changed_layers == () and all("already compensated" in c.what for c in twice.changes)
    np.testing.assert_array_equal(logits(twice.model), logits(once.model))
    assert ir.to_proto(tiny.onnx).SerializeToString() == before
    plain = parallelize(tiny.onnx, {0, 2}).model
    extra = len(once.model.graph) - len(plain.graph)  # one bias Add per block where the mlp had no bias
    assert extra == (0 if FAMILIES[tiny.torch.config.model_type].mlp_bias else 2)
    assert metadata.history(once.model)[-1]["pass"] == "compensate"


def test_gate_fix_is_the_calibrated_block(tiny):
    alpha = {0: 0.7, 2: 1.3}
    expected = tiny.reference(parallel=set(alpha), branch_edits=[("mlp", "scale", {l}, a) for l, a in alpha.items()])
    assert_logits_equal(compensate(tiny.onnx, {l: Fix.gate(a) for l, a in alpha.items()}).model, expected)


def test_parallel_families_and_fused_blocks_refuse_compensation(fixture_path):
    with pytest.raises(SurgeryError, match="parallel in the model as exported"):
        compensate(graph.load(fixture_path("gpt_neox_parallel")), {0: Fix.gate(0.9)})
    fused = fuse(graph.load(fixture_path("llama")), {1}).model
    with pytest.raises(SurgeryError, match="block 1: it is fused"):
        compensate(fused, {1: Fix.gate(0.9)})
    assert compensate(fused, {0: Fix.gate(0.9)}).changed_layers == (0,)


def test_compensated_kv_cache_folder_generates_like_the_hooked_model(tmp_path, tiny_export):
    from optimum.onnxruntime import ORTModelForCausalLM

    from tests.reference import Edits

    tiny = Exported(tiny_export("llama", seed=5))
    arrays = planted(tiny.torch.config.hidden_size, {0, 2})
    out = graph.write(compensate(tiny.onnx, {l: Fix(*a) for l, a in arrays.items()}).model, tmp_path / "comp", like=tiny.folder)
    before = [(v.name, v.dtype, str(v.shape)) for v in (*tiny.onnx.graph.inputs, *tiny.onnx.graph.outputs)]
    written = graph.load(out)
    assert [(v.name, v.dtype, str(v.shape)) for v in (*written.graph.inputs, *written.graph.outputs)] == before
    prompt = torch.from_numpy(IDS[:1, :5])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = ORTModelForCausalLM.from_pretrained(out.parent).generate(prompt, **kwargs)
    with Edits(tiny.torch, {0, 2}, fixes=arrays), torch.no_grad():
        expected = tiny.torch.generate(prompt, **kwargs)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_residual_multipliers_fold_into_the_projections(tiny_export):
    """Granite scales each branch output by residual_multiplier (0.4 here) before the residual add. The fix acts on
    the scaled outputs A, P; the hooked model sees the branches before the scale, so it adds A w_a + P w_p + b / 0.4
    there. Compensated (written and switched in a switchboard) and fused blocks keep the scale."""
    from surgery.analysis import switchboard as board_graph
    from surgery.model.nodes import values_by_name
    from surgery.passes import projection

    tiny = Exported(tiny_export("granite", seed=5))
    c = tiny.torch.config.residual_multiplier
    model, layers = tiny.onnx, {0, 2}
    block = find_blocks(model)[0]
    assert projection.producing(values_by_name(model)[block.mlp_out], 0, "mlp_out").scale == pytest.approx(c)
    arrays = planted(tiny.torch.config.hidden_size, layers)
    fixes = {l: Fix(*a) for l, a in arrays.items()}
    expected = edited_logits(tiny.torch, IDS, parallel=layers, fixes={l: (w_a, w_p, b / c) for l, (w_a, w_p, b) in arrays.items()})
    assert np.abs(edited_logits(tiny.torch, IDS, parallel=layers, fixes=arrays) - expected).max() > 1e-3  # b / c matters
    for result in (compensate(model, fixes), fuse(model, layers, fixes)):
        assert_logits_equal(result.model, expected)
    board = board_graph.switchboard(model, kinds(fixes))
    on = switched(3, {layer: "compensated" for layer in layers})
    assert_logits_equal(board, expected, extra={board_graph.SWITCHES: on})
