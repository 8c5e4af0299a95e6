"""A Llama-shaped decoder with random weights streamed to external data: GB-sized models in little memory.

    python graphs/big_decoder.py OUT_DIR --layers 10        # 2.29 GB; or write(folder, layers) from Python

TinyLlama-1.1B's shapes (SHAPE): d_model 2048, 32 heads of 64 with 4 KV heads (grouped-query),
rotary positions, SwiGLU mlp of 5632, vocab 32000, float32. Each block is 176 MB, the embedding and
the head 262 MB each, so `layers` blocks make 524 MB + layers x 176 MB (layers_for(bytes) inverts it).
Weights are written tensor by tensor into OUT_DIR/model.onnx.data (offsets 4 KiB aligned; each is
cut from one 64 MB pool of random numbers, so writing peaks near 280 MB of RSS at any size) and
the graph references them as ir.ExternalTensor; the folder gets the fixtures' tokenizer, so every
command (fits included) runs on it. forward() is an independent NumPy reference of the same
network, with the plain-parallel and mlp-tangential edits.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from collections.abc import Collection
from pathlib import Path

import numpy as np
import onnx_ir as ir

HERE = Path(__file__).resolve().parent
SHAPE = dict(d_model=2048, n_heads=32, n_kv_heads=4, d_mlp=5632, vocab=32000, max_pos=2048)
DATA = "model.onnx.data"
EPS = 1e-5
_POOL = 1 << 24  # float32 numbers: 64 MB
_ALIGN = 4096


def block_bytes(d_model, n_heads, n_kv_heads, d_mlp, **_) -> int:
    """Float32 bytes of one block's weights: q, k, v, o, gate, up, down and two norm scales."""
    d_kv = d_model // n_heads * n_kv_heads
    return 4 * (2 * d_model * d_model + 2 * d_model * d_kv + 3 * d_model * d_mlp + 2 * d_model)


def model_bytes(layers: int, shape: dict = SHAPE) -> int:
    """Float32 bytes of all weights: embedding, `layers` blocks, final norm, head (rotary tables aside)."""
    return 4 * (2 * shape["vocab"] * shape["d_model"] + shape["d_model"]) + layers * block_bytes(**shape)


def layers_for(nbytes: float, shape: dict = SHAPE) -> int:
    """The fewest blocks whose model has at least `nbytes` of weights."""
    return max(1, math.ceil((nbytes - model_bytes(0, shape)) / block_bytes(**shape)))


class _Writer:
    """Appends weights to the data file and returns graph values referencing them."""

    def __init__(self, folder: Path, seed: int):
        self.folder, self.file = folder, open(folder / DATA, "wb")
        self.rng = np.random.default_rng(seed)
        # uniform on [-sqrt 3, sqrt 3]: unit variance; every weight is scaled slices of this pool
        self.pool = self.rng.uniform(-math.sqrt(3), math.sqrt(3), _POOL).astype(np.float32)
        self.values: list[ir.Value] = []

    def weight(self, name: str, shape: tuple[int, ...], scale: float, offset: float = 0.0) -> ir.Value:
        size = math.prod(shape)
        start = self.file.seek(-self.file.tell() % _ALIGN, 1)
        left = size
        while left:  # one pool slice at a time, never the whole tensor in memory
            n = min(left, _POOL // 2)
            at = int(self.rng.integers(0, _POOL - n + 1))
            self.file.write((self.pool[at : at + n] * np.float32(scale) + np.float32(offset)).tobytes())
            left -= n
        tensor = ir.ExternalTensor(DATA, offset=start, length=4 * size, dtype=ir.DataType.FLOAT, shape=ir.Shape(shape), name=name, base_dir=self.folder)
        value = ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(shape), const_value=tensor)
        self.values.append(value)
        return value

    def inline(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        self.values.append(value)
        return value


def write(folder: str | Path, layers: int, seed: int = 0, shape: dict = SHAPE) -> Path:
    """Write folder/model.onnx, its external data and a tokenizer; returns the .onnx path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d, h, kv, d_mlp, vocab, max_pos = (shape[k] for k in ("d_model", "n_heads", "n_kv_heads", "d_mlp", "vocab", "max_pos"))
    dh = d // h
    w = _Writer(folder, seed)
    nodes: list[ir.Node] = []

    def op(op_type, *inputs, **attrs):
        outputs = attrs.get("num_outputs", 1)
        node = ir.node(op_type, list(inputs), attributes=attrs, num_outputs=outputs)
        for i, out in enumerate(node.outputs):
            out.name = f"v{len(nodes)}" + (f"_{i}" if outputs > 1 else "")
        nodes.append(node)
        return node.outputs[0] if outputs == 1 else node.outputs

    ints = lambda name, *xs: w.inline(name, np.array(xs, np.int64))  # noqa: E731
    floats = lambda name, x: w.inline(name, np.array(x, np.float32))  # noqa: E731
    two, eps, last = floats("two", 2.0), floats("eps", EPS), ints("last_axis", -1)
    heads_shape, kv_shape, merged = ints("q_shape", 0, 0, h, dh), ints("kv_shape", 0, 0, kv, dh), ints("merged_shape", 0, 0, d)
    expand, grouped, axis2 = ints("kv_expand", 1, 1, h // kv, 1, 1), ints("grouped_shape", 0, h, -1, dh), ints("axis2", 2)
    zero, axis0, above = ints("zero", 0), ints("axis0", 0), w.inline("above_diagonal", np.array(1, np.int64))
    inv_scale = floats("inv_sqrt_d_head", 1.0 / math.sqrt(dh))
    angles = np.arange(max_pos)[:, None] * (10000.0 ** (-np.arange(0, dh, 2) / dh))[None, :]
    cos_table = w.inline("rotary.cos", np.cos(np.concatenate([angles, angles], 1)).astype(np.float32))  # [max_pos, d_head]
    sin_table = w.inline("rotary.sin", np.sin(np.concatenate([angles, angles], 1)).astype(np.float32))

    def rms(x, scale):
        mean = op("ReduceMean", op("Pow", x, two), last, keepdims=1)
        return op("Mul", op("Div", x, op("Sqrt", op("Add", mean, eps))), scale)

    ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "seq"]))
    seq = op("Shape", ids, start=1, end=2)  # [1]
    cos, sin = (op("Slice", table, zero, seq, axis0) for table in (cos_table, sin_table))  # [seq, d_head]
    mask = op("Trilu", op("ConstantOfShape", op("Concat", seq, seq, axis=0), value=ir.tensor(np.array([-1e9], np.float32))), above, upper=1)  # [seq, seq]: -1e9 above the diagonal

    def rotary(x):  # [batch, heads, seq, d_head]
        first, second = op("Split", x, axis=-1, num_outputs=2)
        return op("Add", op("Mul", x, cos), op("Mul", op("Concat", op("Neg", second), first, axis=-1), sin))

    x = op("Gather", w.weight("embed", (vocab, d), 1.0), ids)  # [batch, seq, d_model]
    for layer in range(layers):
        p = f"blocks.{layer}"
        a = rms(x, w.weight(f"{p}.ln1", (d,), 0.1, 1.0))
        q = rotary(op("Transpose", op("Reshape", op("MatMul", a, w.weight(f"{p}.attn.q", (d, d), d**-0.5)), heads_shape), perm=[0, 2, 1, 3]))
        k = rotary(op("Transpose", op("Reshape", op("MatMul", a, w.weight(f"{p}.attn.k", (d, kv * dh), d**-0.5)), kv_shape), perm=[0, 2, 1, 3]))
        v = op("Transpose", op("Reshape", op("MatMul", a, w.weight(f"{p}.attn.v", (d, kv * dh), d**-0.5)), kv_shape), perm=[0, 2, 1, 3])
        k, v = (op("Reshape", op("Expand", op("Unsqueeze", t, axis2), expand), grouped) for t in (k, v))  # [batch, heads, seq, d_head]
        scores = op("Add", op("Mul", op("MatMul", q, op("Transpose", k, perm=[0, 1, 3, 2])), inv_scale), mask)
        attn = op("Reshape", op("Transpose", op("MatMul", op("Softmax", scores, axis=-1), v), perm=[0, 2, 1, 3]), merged)
        x = op("Add", x, op("MatMul", attn, w.weight(f"{p}.attn.o", (d, d), d**-0.5)))  # resid_mid
        m = rms(x, w.weight(f"{p}.ln2", (d,), 0.1, 1.0))
        gate, up = op("MatMul", m, w.weight(f"{p}.mlp.gate", (d, d_mlp), d**-0.5)), op("MatMul", m, w.weight(f"{p}.mlp.up", (d, d_mlp), d**-0.5))
        hidden = op("Mul", op("Mul", gate, op("Sigmoid", gate)), up)
        x = op("Add", x, op("MatMul", hidden, w.weight(f"{p}.mlp.down", (d_mlp, d), d_mlp**-0.5)))  # resid_post
    logits = op("MatMul", rms(x, w.weight("ln_f", (d,), 0.1, 1.0)), w.weight("head", (d, vocab), d**-0.5))
    w.file.close()
    logits.name, logits.dtype, logits.shape = "logits", ir.DataType.FLOAT, ir.Shape(["batch", "seq", vocab])
    graph = ir.Graph([ids], [logits], nodes=nodes, initializers=w.values, opset_imports={"": 18}, name="big_decoder")
    model = ir.Model(graph, ir_version=9, producer_name="graphs/big_decoder.py")
    ir.save(model, folder / "model.onnx")  # external tensors stay references
    for item in (HERE / "tokenizer").iterdir():
        shutil.copy2(item, folder / item.name)
    return folder / "model.onnx"


def forward(model_path: str | Path, ids: np.ndarray, parallel: Collection[int] = (), mlp_tangential: Collection[int] = (), shape: dict = SHAPE) -> np.ndarray:
    """NumPy logits [batch, seq, vocab] of the model write() made; blocks in `parallel` have ln2 read
    resid_pre, blocks in `mlp_tangential` add only the part of mlp_out orthogonal to the mlp's input."""
    model = ir.load(model_path)
    weights = {name: v.const_value.numpy() for name, v in model.graph.initializers.items()}
    d, h, kv = shape["d_model"], shape["n_heads"], shape["n_kv_heads"]
    dh, (batch, seq) = d // h, ids.shape
    layers = sum(1 for name in weights if name.endswith(".attn.q"))
    cos, sin = weights["rotary.cos"][:seq], weights["rotary.sin"][:seq]

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * scale

    def heads(t, n):  # [batch, seq, n * d_head] -> [batch, n, seq, d_head]
        return t.reshape(batch, seq, n, dh).transpose(0, 2, 1, 3)

    def rotate(t):
        half = dh // 2
        return t * cos + np.concatenate([-t[..., half:], t[..., :half]], axis=-1) * sin

    causal = np.triu(np.full((seq, seq), -np.inf, np.float32), 1)
    x = weights["embed"][ids]
    for layer in range(layers):
        W = {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"blocks.{layer}.")}  # noqa: N806
        a = rms(x, W["ln1"])
        q, k, v = rotate(heads(a @ W["attn.q"], h)), rotate(heads(a @ W["attn.k"], kv)), heads(a @ W["attn.v"], kv)
        k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        mid = x + (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d) @ W["attn.o"]
        mlp_in = x if layer in parallel else mid
        m = rms(mlp_in, W["ln2"])
        gate = m @ W["mlp.gate"]
        out = (gate / (1 + np.exp(-gate)) * (m @ W["mlp.up"])) @ W["mlp.down"]
        if layer in mlp_tangential:
            out = out - np.sum(out * mlp_in, -1, keepdims=True) / np.sum(mlp_in * mlp_in, -1, keepdims=True) * mlp_in
        x = mid + out
    return rms(x, weights["ln_f"]) @ weights["head"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write(args.out, args.layers, args.seed)
    print(f"{path}: {args.layers} blocks, {model_bytes(args.layers) / 1e9:.2f} GB of weights", file=sys.stderr)


if __name__ == "__main__":
    main()
