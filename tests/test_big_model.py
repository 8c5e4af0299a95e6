"""A pass over a model with >= 1 GB of external data never reads the weights into memory."""

import hashlib
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import pytest

from surgery import graph
from surgery.blocks import find_blocks

pytestmark = pytest.mark.slow
D, VOCAB, LAYERS = 1024, 262_144, 2  # the embedding alone is 1 GiB of float32


def _decoder(rng) -> ir.Model:
    """A minimal decoder: embedding, LAYERS sequential RMSNorm blocks (1-head attention, ReLU mlp), head."""
    nodes, inits = [], []

    def w(name, *shape):
        value = ir.Value(name=name, const_value=ir.tensor(rng.standard_normal(shape, dtype=np.float32) * 0.02, name=name))
        inits.append(value)
        return value

    def op(op_type, *inputs, **attrs):
        node = ir.node(op_type, list(inputs), attributes=attrs)
        node.outputs[0].name = f"v{len(nodes)}"
        nodes.append(node)
        return node.outputs[0]

    two, axes = w("two", 1), w("axes", 1)
    two.const_value = ir.tensor(np.array([2.0], np.float32), name="two")
    axes.const_value = ir.tensor(np.array([-1], np.int64), name="axes")

    def rms(x, scale):
        mean = op("ReduceMean", op("Pow", x, two), axes, keepdims=1)
        return op("Mul", op("Div", x, op("Sqrt", mean)), scale)

    ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "seq"]))
    x = op("Gather", w("embed", VOCAB, D), ids)
    for layer in range(LAYERS):
        a = rms(x, w(f"ln1.{layer}", D))
        q, k, v = (op("MatMul", a, w(f"{n}.{layer}", D, D)) for n in "qkv")
        probs = op("Softmax", op("MatMul", q, op("Transpose", k, perm=[0, 2, 1])), axis=-1)
        h = op("Add", x, op("MatMul", op("MatMul", probs, v), w(f"o.{layer}", D, D)))
        m = rms(h, w(f"ln2.{layer}", D))
        x = op("Add", h, op("MatMul", op("Relu", op("MatMul", m, w(f"up.{layer}", D, 2 * D))), w(f"down.{layer}", 2 * D, D)))
    logits = op("MatMul", rms(x, w("ln_f", D)), w("head", D, 64))
    logits.name = "logits"
    logits.dtype = ir.DataType.FLOAT
    g = ir.Graph([ids], [logits], nodes=nodes, initializers=inits, opset_imports={"": 18})
    return ir.Model(g, ir_version=9)


def _sha(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _run(script: str) -> list[str]:
    """Run `script` in a fresh interpreter; check its peak RSS (printed as RSS_KB n) stays under 400 MB."""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    words = run.stdout.split()
    peak_mb = int(words[words.index("RSS_KB") + 1]) / 1024
    assert peak_mb < 400, f"peak RSS {peak_mb:.0f} MB for 1 GiB of weights; stderr: {run.stderr[-2000:]}"
    return words


def test_parallelize_big_external_data_model_in_small_memory(tmp_path):
    src_dir, out_dir = tmp_path / "in", tmp_path / "out"
    src_dir.mkdir()
    ir.save(_decoder(np.random.default_rng(0)), src_dir / "big.onnx", external_data="big.onnx.data")
    data = src_dir / "big.onnx.data"
    assert data.stat().st_size >= 2**30
    before = {p.name: _sha(p) for p in src_dir.iterdir()}

    script = (
        "import sys\n"
        "from surgery.cli import app\n"
        "try:\n"
        f"    app(['parallelize', {str(src_dir / 'big.onnx')!r}, '--layers', 'all', '-o', {str(out_dir / 'big.onnx')!r}])\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the (big) parent across fork+exec
        "peak = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print('RSS_KB', peak, 'EXIT', code)\n"
    )
    words = _run(script)
    assert words[words.index("EXIT") + 1] in ("0", "None")

    assert {p.name: _sha(p) for p in src_dir.iterdir()} == before  # input untouched
    assert _sha(out_dir / "big.onnx.data") == before["big.onnx.data"]  # weights copied intact
    src, out = graph.load(src_dir / "big.onnx"), graph.load(out_dir / "big.onnx")
    refs = lambda m: {k: (v.const_value.location, v.const_value.offset, v.const_value.length) for k, v in m.graph.initializers.items() if isinstance(v.const_value, ir.ExternalTensor)}  # noqa: E731
    assert refs(out) == refs(src) and len(refs(src)) >= 10
    assert [b.form for b in find_blocks(out)] == ["parallel"] * LAYERS
    assert [b.form for b in find_blocks(src)] == ["sequential"] * LAYERS


def test_compensate_big_external_data_model_reads_only_the_folded_weights(tmp_path):
    src_dir, out_dir = tmp_path / "in", tmp_path / "out"
    src_dir.mkdir()
    ir.save(_decoder(np.random.default_rng(0)), src_dir / "big.onnx", external_data="big.onnx.data")
    before = {p.name: _sha(p) for p in src_dir.iterdir()}
    script = (
        "import numpy as np\n"
        "from surgery import graph\n"
        "from surgery.passes import Fix, compensate\n"
        f"model = graph.load({str(src_dir / 'big.onnx')!r})\n"
        f"rng = np.random.default_rng(1); d = {D}\n"
        "fixes = {l: Fix(0.01 * rng.standard_normal((d, d)), 0.01 * rng.standard_normal((d, d)), rng.standard_normal(d)) for l in (0, 1)}\n"
        f"graph.write(compensate(model, fixes).model, {str(out_dir / 'big.onnx')!r}, like={str(src_dir / 'big.onnx')!r})\n"
        "print('RSS_KB', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
    )
    _run(script)
    assert {p.name: _sha(p) for p in src_dir.iterdir()} == before  # input untouched
    src, out = graph.load(src_dir / "big.onnx"), graph.load(out_dir / "big.onnx")
    refs = lambda m: {k: (v.const_value.location, v.const_value.offset) for k, v in m.graph.initializers.items() if isinstance(v.const_value, ir.ExternalTensor)}  # noqa: E731
    folded = {f"o.{l}" for l in range(LAYERS)} | {f"down.{l}" for l in range(LAYERS)}
    assert refs(out) == {k: v for k, v in refs(src).items() if k not in folded}  # every other weight: the same bytes on disk
    assert [b.fix for b in find_blocks(out)] == ["compensated"] * LAYERS
