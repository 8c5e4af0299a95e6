import numpy as np
import onnx_ir as ir
import pytest

from surgery import graph, runtime
from surgery.analysis import probe as probe_graph
from surgery.blocks import find_blocks
from surgery.errors import SurgeryError
from tests.helpers import linear_model

FAMILIES = ["gpt2", "gpt_neox", "gpt_neox_parallel", "llama", "qwen2", "mistral", "phi3"]  # Phi-3: one fused gate_up projection
BRANCH_NORMED = ["gemma2", "olmo2"]  # norms on the branch outputs: the stream is told from a branch by dependence
EXPORTS = [("optimum", True), ("optimum", False), ("dynamo", False)]
CASES = [(f, *e) for f in FAMILIES for e in EXPORTS] + [(f, *e) for f in BRANCH_NORMED for e in (EXPORTS[0], EXPORTS[2])]


@pytest.mark.parametrize("family,exporter,past", CASES, ids=[f"{f}-{e}{'-past' if p else ''}" for f, e, p in CASES])
def test_found_tensors_equal_the_hooked_hf_model(family, exporter, past, tiny_export):
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from tests.reference import block_tensors

    tiny = tiny_export(family, exporter=exporter, past=past, seed=0)
    model = graph.load(tiny.onnx)
    blocks = find_blocks(model)

    reference = AutoModelForCausalLM.from_pretrained(tiny.hf, attn_implementation="eager").eval()
    assert len(blocks) == reference.config.num_hidden_layers
    parallel = family.endswith("parallel")
    assert all(b.is_parallel == parallel for b in blocks)
    ln = {"olmo2": "none"}.get(family, "LayerNorm" if family.startswith("gpt") else "RMSNorm")  # OLMo 2: no norm before a branch
    assert all(ln in b.ln_kind for b in blocks)
    assert all(b.mlp_kind == ("plain" if family.startswith("gpt") else "gated") for b in blocks)

    ids = np.random.default_rng(0).integers(0, reference.config.vocab_size, size=(2, 11))
    names = [(b.layer, key, value) for b in blocks for key, value in b.tensors().items()]
    tapped = probe_graph.tap(model, [value for _, _, value in names])
    session = runtime.session(tapped)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, runtime.feeds(session, ids))))
    logits, expected = block_tensors(reference, ids)

    np.testing.assert_allclose(got["logits"], logits, rtol=1e-4, atol=1e-4)
    for layer, key, value in names:
        np.testing.assert_allclose(got[value], expected[layer][key], rtol=1e-4, atol=1e-4, err_msg=f"blocks.{layer}.{key}")
    assert set(expected[0]) == set(blocks[0].tensors())  # every hooked tensor was found


def _quantized(source, out, how):
    """`source` (a model.onnx) quantized to int8 by onnxruntime.quantization, as people do it: `dynamic`
    (quantize_dynamic: DynamicQuantizeLinear, MatMulInteger, Cast, Mul), `dynamic-fused` (its MatMuls, saved
    by an ORT session: DynamicQuantizeMatMul, MatMulIntegerToFloat) or `qdq` (quantize_static:
    QuantizeLinear, DequantizeLinear). Returns the path of the quantized model.onnx."""
    import onnxruntime as ort
    from onnxruntime import quantization as q

    out.mkdir()
    if how == "qdq":
        session = runtime.session(graph.load(source))
        feeds = iter([runtime.feeds(session, np.random.default_rng(0).integers(0, 512, size=(1, 8)))])
        reader = type("Reader", (q.CalibrationDataReader,), {"get_next": lambda self: next(feeds, None)})()
        q.quantize_static(str(source), str(out / "model.onnx"), reader, quant_format=q.QuantFormat.QDQ, op_types_to_quantize=["MatMul", "Gemm"])
        return out / "model.onnx"
    # ORT's session optimizer copies the quantized embedding table's DequantizeLinear per reader, which
    # splits the residual stream: the fused form quantizes the MatMuls only.
    types = ["MatMul", "Gemm"] if how == "dynamic-fused" else None
    q.quantize_dynamic(str(source), str(out / "model.onnx"), weight_type=q.QuantType.QInt8, op_types_to_quantize=types)
    if how == "dynamic":
        return out / "model.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(out / "fused.onnx")
    ort.InferenceSession(str(out / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return out / "fused.onnx"


QUANTIZED_OP = {"dynamic": "MatMulInteger", "dynamic-fused": "DynamicQuantizeMatMul", "qdq": "DequantizeLinear"}


@pytest.mark.parametrize("how", list(QUANTIZED_OP))
@pytest.mark.parametrize("family,mlp", [("llama", "gated"), ("gpt2", "plain"), ("gpt_neox_parallel", "plain")])
def test_an_int8_quantized_mlp_keeps_its_kind(fixture_path, tmp_path, family, mlp, how):
    """The mlp kind reads through quantizers: act(gate) * up is gated with its projections in int8."""
    import shutil

    source = tmp_path / "fp32.onnx"  # a copy: the quantizer writes model-inferred.onnx beside its input, which two
    shutil.copy2(fixture_path(family) / "model.onnx", source)  # workers quantizing the shared fixture would race for
    path = _quantized(source, tmp_path / "int8", how)
    model = graph.load(path)
    assert QUANTIZED_OP[how] in {n.op_type for n in model.graph}
    blocks = find_blocks(model)
    assert [b.mlp_kind for b in blocks] == [mlp] * 3
    assert [b.form for b in blocks] == [b.form for b in find_blocks(graph.load(fixture_path(family)))]


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


def test_no_blocks_is_one_clear_error():
    with pytest.raises(SurgeryError, match=r"found no transformer blocks in m\.onnx: it has no LayerNorm or RMSNorm"):
        find_blocks(linear_model(), where="m.onnx")


def test_norm_without_residual_is_one_clear_error():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 3, 4]))
    scale = ir.Value(name="scale", const_value=ir.tensor(np.ones(4, dtype=np.float32)))
    ln = ir.node("LayerNormalization", [x, scale], attributes={"axis": -1})
    g = ir.Graph([x], ln.outputs, nodes=[ln], initializers=[scale], opset_imports={"": 18})
    with pytest.raises(SurgeryError, match="no residual Add"):
        find_blocks(ir.Model(g, ir_version=9))
