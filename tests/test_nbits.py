"""MatMulNBits weights as arrays (surgery.model.nbits): what ONNX Runtime multiplies by, and requantization on the node's
own scales, round-to-nearest and error-aware."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from surgery.engine import runtime
from surgery.model import nbits

K, N = 96, 40


def quantized_matmul(weight: np.ndarray, bits: int, symmetric: bool, block_size: int = 32) -> ir.Model:
    """x @ weight as onnxruntime.quantization's MatMulNBitsQuantizer writes it, computing with fp32 activations."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    w = onnx.numpy_helper.from_array(weight.astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, weight.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, weight.shape[1]])], [w])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=block_size, is_symmetric=symmetric, accuracy_level=0)
    quantizer.process()
    return ir.from_proto(quantizer.model.model)


def the_node(model: ir.Model) -> ir.Node:
    (node,) = [n for n in model.graph if n.op_type == nbits.OP]
    return node


@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, False)], ids=["4-bit", "4-bit-zero-points", "8-bit"])
def test_the_dequantized_weight_is_what_onnxruntime_multiplies_by(bits, symmetric):
    rng = np.random.default_rng(0)
    model = quantized_matmul(rng.standard_normal((K, N)), bits, symmetric)
    q = nbits.read(the_node(model))
    x = rng.standard_normal((5, K)).astype(np.float32)
    got = runtime.session(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x.astype(np.float64) @ q.dequantize(), rtol=1e-5, atol=1e-5)
    assert (len(the_node(model).inputs) > nbits.ZERO_POINTS and the_node(model).inputs[nbits.ZERO_POINTS] is not None) == (not symmetric)
    assert q.codes.max() <= (1 << bits) - 1
    np.testing.assert_array_equal(q.packed(q.codes), the_node(model).inputs[nbits.B].const_value.numpy())


@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, False)], ids=["4-bit", "4-bit-zero-points", "8-bit"])
def test_requantizing_an_unchanged_weight_gives_back_its_own_codes(bits, symmetric):
    rng = np.random.default_rng(1)
    q = nbits.read(the_node(quantized_matmul(rng.standard_normal((K, N)), bits, symmetric)))
    x = rng.standard_normal((300, K))
    np.testing.assert_array_equal(q.round(q.dequantize()), q.codes)
    np.testing.assert_array_equal(q.gptq(q.dequantize(), x.T @ x), q.codes)


def test_round_to_nearest_is_the_numpy_rounding_on_the_node_s_scales():
    rng = np.random.default_rng(2)
    q = nbits.read(the_node(quantized_matmul(rng.standard_normal((K, N)), 4, True)))
    changed = q.dequantize() + 0.3 * rng.standard_normal((K, N)) * np.repeat(q.scales, 32, axis=1).T
    step = np.repeat(q.scales, 32, axis=1).T  # [K, N]
    expected = np.clip(np.floor(changed / step + 0.5) + 8, 0, 15)  # no half-way cases in random data
    np.testing.assert_array_equal(q.round(changed)[:, :K], expected.T)


def test_error_aware_requantization_lowers_the_output_error_of_a_small_change():
    """A fix much smaller than the rounding step: rounded to nearest it is mostly lost, error-aware (GPTQ) codes keep
    more of it on inputs like the calibration ones (correlated features, as activations are)."""
    rng = np.random.default_rng(3)
    q = nbits.read(the_node(quantized_matmul(rng.standard_normal((K, N)), 4, True)))
    mix = rng.standard_normal((K, K)) / np.sqrt(K) + np.eye(K)
    fit, held_out = rng.standard_normal((2000, K)) @ mix, rng.standard_normal((2000, K)) @ mix
    target = q.dequantize() @ (np.eye(N) + 0.02 * rng.standard_normal((N, N)))
    error = lambda codes: np.sum((held_out @ (nbits.Quantized(**{**q.__dict__, "codes": codes}).dequantize() - target)) ** 2)  # noqa: E731
    unchanged, nearest, aware = error(q.codes), error(q.round(target)), error(q.gptq(target, fit.T @ fit))
    assert nearest < unchanged and aware < 0.8 * nearest
