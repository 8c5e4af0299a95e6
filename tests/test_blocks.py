import numpy as np
import onnx_ir as ir
import pytest

from surgery import graph, runtime
from surgery.blocks import find_blocks
from surgery.errors import SurgeryError

FAMILIES = ["gpt2", "gpt_neox", "gpt_neox_parallel", "llama", "qwen2", "mistral"]
BRANCH_NORMED = ["gemma2", "olmo2"]  # norms on the branch outputs: the stream is told from a branch by dependence
EXPORTS = [("optimum", True), ("optimum", False), ("dynamo", False)]
CASES = [(f, *e) for f in FAMILIES for e in EXPORTS] + [(f, *e) for f in BRANCH_NORMED for e in (EXPORTS[0], EXPORTS[2])]


@pytest.mark.parametrize("family,exporter,past", CASES, ids=[f"{f}-{e}{'-past' if p else ''}" for f, e, p in CASES])
def test_found_tensors_equal_the_hooked_hf_model(family, exporter, past, tmp_path):
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from graphs.make_fixtures import save_tiny
    from surgery.export import export
    from tests.reference import block_tensors

    hf = save_tiny(family, tmp_path / "hf")
    export(str(hf), tmp_path / "onnx", past=past, exporter=exporter)
    model = graph.load(tmp_path / "onnx")
    blocks = find_blocks(model)

    reference = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    assert len(blocks) == reference.config.num_hidden_layers
    parallel = family.endswith("parallel")
    assert all(b.is_parallel == parallel for b in blocks)
    ln = {"olmo2": "none"}.get(family, "LayerNorm" if family.startswith("gpt") else "RMSNorm")  # OLMo 2: no norm before a branch
    assert all(ln in b.ln_kind for b in blocks)
    assert all(b.mlp_kind == ("plain" if family.startswith("gpt") else "gated") for b in blocks)

    ids = np.random.default_rng(0).integers(0, reference.config.vocab_size, size=(2, 11))
    names = [(b.layer, key, value) for b in blocks for key, value in b.tensors().items()]
    tapped = graph.tap(model, [value for _, _, value in names])
    session = runtime.session(tapped)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, runtime.feeds(session, ids))))
    logits, expected = block_tensors(reference, ids)

    np.testing.assert_allclose(got["logits"], logits, rtol=1e-4, atol=1e-4)
    for layer, key, value in names:
        np.testing.assert_allclose(got[value], expected[layer][key], rtol=1e-4, atol=1e-4, err_msg=f"blocks.{layer}.{key}")
    assert set(expected[0]) == set(blocks[0].tensors())  # every hooked tensor was found


@pytest.mark.parametrize(
    "family,form,ln,mlp",
    [("llama", "sequential", "RMSNorm (decomposed)", "gated"), ("gpt2", "sequential", "LayerNorm (fused op)", "plain"),
     ("gpt_neox_parallel", "parallel", "LayerNorm (fused op)", "plain")],
)
def test_fixtures_without_torch(fixture_path, family, form, ln, mlp):
    blocks = find_blocks(graph.load(fixture_path(family)))
    assert [b.layer for b in blocks] == [0, 1, 2]
    assert {(b.form, b.ln_kind, b.mlp_kind) for b in blocks} == {(form, ln, mlp)}
    # The stream is one chain: each block starts where the previous one ended.
    assert all(a.resid_post == b.resid_pre for a, b in zip(blocks, blocks[1:]))
    assert all(b.mlp_in == (b.resid_pre if b.is_parallel else b.resid_mid) for b in blocks)


def _linear_model() -> ir.Model:
    """x -> MatMul -> Relu -> MatMul: a graph with no normalisation or residual."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 4]))
    w = ir.Value(name="w", const_value=ir.tensor(np.eye(4, dtype=np.float32)))
    a = ir.node("MatMul", [x, w])
    r = ir.node("Relu", [a.outputs[0]])
    b = ir.node("MatMul", [r.outputs[0], w])
    g = ir.Graph([x], b.outputs, nodes=[a, r, b], initializers=[w], opset_imports={"": 18})
    return ir.Model(g, ir_version=9)


def test_no_blocks_is_one_clear_error():
    with pytest.raises(SurgeryError, match=r"found no transformer blocks in m\.onnx: it has no LayerNorm or RMSNorm"):
        find_blocks(_linear_model(), where="m.onnx")


def test_norm_without_residual_is_one_clear_error():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 3, 4]))
    scale = ir.Value(name="scale", const_value=ir.tensor(np.ones(4, dtype=np.float32)))
    ln = ir.node("LayerNormalization", [x, scale], attributes={"axis": -1})
    g = ir.Graph([x], ln.outputs, nodes=[ln], initializers=[scale], opset_imports={"": 18})
    with pytest.raises(SurgeryError, match="no residual Add"):
        find_blocks(ir.Model(g, ir_version=9))
