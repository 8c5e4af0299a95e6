import numpy as np
import onnx_ir as ir
import pytest

from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.model.blocks import find_blocks
from tests.helpers import COMMITTED, FAMILIES, assert_found_tensors_equal_hooked, linear_model

PLAIN_NORMED = ["gpt2", "gpt_neox", "gpt_neox_parallel", "llama", "qwen2", "mistral", "phi3"]
BRANCH_NORMED = [f for f in FAMILIES if FAMILIES[f].post_norm and FAMILIES[f].layout]  # Gemma 2, OLMo 2
EXPORTS = [("optimum", True), ("optimum", False), ("dynamo", False)]
CASES = [(f, *e) for f in PLAIN_NORMED for e in EXPORTS] + [(f, *e) for f in BRANCH_NORMED for e in (EXPORTS[0], EXPORTS[2])]


@pytest.mark.parametrize("family,exporter,past", CASES, ids=[f"{f}-{e}{'-past' if p else ''}" for f, e, p in CASES])
def test_found_tensors_equal_the_hooked_hf_model(family, exporter, past, tiny_export):
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    tiny = tiny_export(family, exporter=exporter, past=past, seed=0)
    model = graph.load(tiny.onnx)
    blocks = find_blocks(model)

    reference = AutoModelForCausalLM.from_pretrained(tiny.hf, attn_implementation="eager").eval()
    assert len(blocks) == reference.config.num_hidden_layers
    f = FAMILIES[family]
    assert all(b.is_parallel == (f.form == "parallel") for b in blocks)
    assert all(f.ln in b.ln_kind for b in blocks)
    assert all(b.mlp_kind == f.mlp for b in blocks)

    ids = np.random.default_rng(0).integers(0, reference.config.vocab_size, size=(2, 11))
    assert_found_tensors_equal_hooked(model, reference, ids)  # every hooked tensor found, each and the logits to 1e-4


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
@pytest.mark.parametrize("family", COMMITTED)
def test_an_int8_quantized_mlp_keeps_its_kind(fixture_path, tmp_path, family, how):
    """The mlp kind reads through quantizers: act(gate) * up is gated with its projections in int8."""
    import shutil

    source = tmp_path / "fp32.onnx"  # a copy: the quantizer writes model-inferred.onnx beside its input, which two
    shutil.copy2(fixture_path(family) / "model.onnx", source)  # workers quantizing the shared fixture would race for
    path = _quantized(source, tmp_path / "int8", how)
    model = graph.load(path)
    assert QUANTIZED_OP[how] in {n.op_type for n in model.graph}
    blocks = find_blocks(model)
    assert [b.mlp_kind for b in blocks] == [FAMILIES[family].mlp] * 3
    assert [b.form for b in blocks] == [b.form for b in find_blocks(graph.load(fixture_path(family)))]


@pytest.mark.parametrize("family", COMMITTED)
def test_fixtures_without_torch(fixture_path, family):
    f = FAMILIES[family]
    blocks = find_blocks(graph.load(fixture_path(family)))
    assert [b.layer for b in blocks] == [0, 1, 2]
    assert {(b.form, b.ln_kind, b.mlp_kind) for b in blocks} == {(f.form, f.fixture_ln, f.mlp)}
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
