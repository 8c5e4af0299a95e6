"""The op tables and the load / save canonicalisation: fused Skip norms split on load and joined on save
compute, and are written back, with the epsilon they were read with."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as ort_schemas

from surgery.engine import runtime
from surgery.files import graph, ops

D = 8


def _skip_norms_graph(path, epsilon: dict[str, float | None]):
    """a, b -> Skip(Simplified)LayerNormalization(a, b, scale[, beta]) with the given epsilon (None: no attribute)."""
    rng = np.random.default_rng(0)
    a = onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1, 3, D])
    b = onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1, 3, D])
    inits = [onnx.numpy_helper.from_array(rng.normal(size=D).astype(np.float32) + 1, name) for name in ("scale", "beta")]
    nodes, outputs = [], []
    for op, eps in epsilon.items():
        inputs = ["a", "b", "scale"] + (["beta"] if op == "SkipLayerNormalization" else [])
        attrs = {} if eps is None else {"epsilon": eps}
        nodes.append(onnx.helper.make_node(op, inputs, [f"{op}_out"], name=op, domain=ops.MS, **attrs))
        outputs.append(onnx.helper.make_tensor_value_info(f"{op}_out", onnx.TensorProto.FLOAT, [1, 3, D]))
    proto = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, "skip_norms", [a, b], outputs, inits),
        opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid(ops.MS, 1)], ir_version=8,
    )
    onnx.save(proto, path)
    return path


def _epsilons(path) -> dict[str, float | None]:
    proto = onnx.load(path)
    found = {}
    for node in proto.graph.node:
        attr = next((a for a in node.attribute if a.name == "epsilon"), None)
        found[node.op_type] = None if attr is None else attr.f
    return found


def test_epsilon_table_equals_onnx_runtime_s_op_schemas():
    defaults = {}
    for schema in ort_schemas.get_all_operator_schema():
        attr = schema.attributes.get("epsilon")
        if schema.name in ops.EPSILON and attr is not None:
            defaults[schema.name] = onnx.AttributeProto.FromString(attr._default_value).f
    assert set(defaults) == set(ops.EPSILON)
    for op, eps in ops.EPSILON.items():
        assert np.float32(eps) == np.float32(defaults[op]), op
    assert ops.EPSILON["SkipSimplifiedLayerNormalization"] == ops.EPSILON["SkipLayerNormalization"] == 1e-12


@pytest.mark.parametrize("epsilon", [None, 1e-6])
def test_skip_norms_are_written_back_with_the_epsilon_they_were_read_with(tmp_path, epsilon):
    src = _skip_norms_graph(tmp_path / "in.onnx", {"SkipSimplifiedLayerNormalization": epsilon, "SkipLayerNormalization": epsilon})
    model = graph.load(src)
    split = [n.op_type for n in model.graph]
    assert "SkipLayerNormalization" not in split and "LayerNormalization" in split  # unfused in memory
    graph.save(model, tmp_path / "out.onnx")
    written = _epsilons(tmp_path / "out.onnx")
    assert written == _epsilons(src)  # None stays None: no attribute was invented
    assert set(written) == {"SkipSimplifiedLayerNormalization", "SkipLayerNormalization"}


def test_split_skip_norms_compute_with_the_schema_default_epsilon(tmp_path):
    src = _skip_norms_graph(tmp_path / "in.onnx", {"SkipSimplifiedLayerNormalization": None, "SkipLayerNormalization": None})
    rng = np.random.default_rng(1)
    feed = {name: (1e-4 * rng.normal(size=(1, 3, D))).astype(np.float32) for name in ("a", "b")}  # mean square ~1e-8
    expected = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feed)
    split = runtime.session(graph.load(src), runtime.Options(device="cpu")).run(None, feed)
    for want, got in zip(expected, split):
        # an epsilon of 1e-5 instead of 1e-12 would shrink these outputs about 30-fold
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        assert np.abs(want).max() > 0.1
