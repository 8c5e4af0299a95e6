"""A pass over a model with >= 1 GB of external data never reads the weights into memory, and one over
a Llama-shaped model past protobuf's 2 GB limit writes outputs that ONNX Runtime runs."""

import hashlib
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import pytest

from graphs import big_decoder
from surgery.engine import runtime
from surgery.files import graph
from surgery.model.blocks import find_blocks

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


def _run(script: str, limit_mb: float = 400) -> list[str]:
    """Run `script` in a fresh interpreter; check its peak RSS (printed as RSS_KB n) stays under `limit_mb`."""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    words = run.stdout.split()
    peak_mb = int(words[words.index("RSS_KB") + 1]) / 1024
    assert peak_mb < limit_mb, f"peak RSS {peak_mb:.0f} MB, limit {limit_mb:.0f} MB; stderr: {run.stderr[-2000:]}"
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
        "from surgery.files import graph\n"
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
    new = {k for k in refs(out) if k.startswith("surgery/compensate/")}  # the folded W_o and W_down
    kept = {k: v for k, v in refs(out).items() if k not in new}
    assert kept == {k: v for k, v in refs(src).items() if k not in folded}  # every other weight: the same bytes on disk
    assert len(new) == 2 * LAYERS and {refs(out)[k][0] for k in new} == {"big.onnx.2.data"}  # written once, beside them
    assert [b.fix for b in find_blocks(out)] == ["compensated"] * LAYERS


def test_llama_past_2_gb_parallelize_then_ablate_runs_in_onnx_runtime(tmp_path):
    """10 TinyLlama-shaped blocks, 2.29 GB of external data (more than a protobuf can hold): inspect finds
    them; plain parallelize, then ablate of its output, each in a fresh process under 0.2 x the model's
    bytes of RSS; the input is untouched, the outputs keep every weight as the same external bytes, and
    ONNX Runtime runs the last output as the NumPy reference of both edits computes it."""
    layers, src, par, abl = 10, tmp_path / "in", tmp_path / "parallel", tmp_path / "ablated"
    try:
        big_decoder.write(src, layers)
        model = graph.load(src)
        assert sum(v.const_value.nbytes for v in model.graph.initializers.values()) > 2**31
        before = {p.name: _sha(p) for p in src.iterdir()}
        script = (
            "from surgery.cli import app\n"
            f"for args in (['inspect', {str(src)!r}], ['parallelize', {str(src)!r}, '--layers', 'all', '-o', {str(par)!r}],\n"
            f"             ['ablate', {str(par)!r}, '--branch', 'mlp', '--mode', 'tangential', '--layers', 'all', '-o', {str(abl)!r}]):\n"
            "    try:\n"
            "        app(args)\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), (args, e.code)\n"
            "print('RSS_KB', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
        )
        words = _run(script, limit_mb=0.2 * graph.size_on_disk(model, src) / 2**20)
        assert re.search(rf"blocks\s+{layers} sequential", " ".join(words))

        assert {p.name: _sha(p) for p in src.iterdir()} == before  # input untouched
        refs = lambda m: {k: (v.const_value.location, v.const_value.offset, v.const_value.length) for k, v in m.graph.initializers.items() if isinstance(v.const_value, ir.ExternalTensor)}  # noqa: E731
        outs = [graph.load(par), graph.load(abl)]
        assert [refs(m) for m in outs] == [refs(model)] * 2 and len(refs(model)) == 9 * layers + 3
        assert [(f / big_decoder.DATA).stat().st_size for f in (par, abl)] == [(src / big_decoder.DATA).stat().st_size] * 2
        assert [b.form for b in find_blocks(outs[1])] == ["parallel"] * layers

        ids = np.array([[0, 17, 300, 5]])
        session = runtime.session(abl / "model.onnx", runtime.Options(device="cpu"))
        got = session.run(["logits"], {"input_ids": ids})[0]
        del session
        every = set(range(layers))
        expected = big_decoder.forward(src / "model.onnx", ids, parallel=every, mlp_tangential=every)
        original = big_decoder.forward(src / "model.onnx", ids)
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
        assert np.abs(expected - original).max() > 0.1  # the edits matter at this tolerance
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # pytest keeps the last runs' folders: 7 GB each
