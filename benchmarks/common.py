"""Shared by the benchmark scripts: the repository on sys.path, the exported SmolLM2-135M (made once under out/),
markdown tables, the GPU's name, kl_budget.py's drift refit, and the GPU suite's synthetic Llama-shaped decoder
(cuda.py, cuda_torch.py: random weights, a KV cache, at Llama-3.2-1B and Llama-3-8B shapes). Not run by itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import json  # noqa: E402  (after the repository is on sys.path)
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import onnx_ir as ir  # noqa: E402

from surgery.files import graph  # noqa: E402
from surgery.model.layers import parse_layers  # noqa: E402
from surgery.passes import Fix  # noqa: E402

SMOLLM2 = ROOT / "out" / "smollm2"


def smollm2() -> Path:
    """The optimum export of SmolLM2-135M (KV cache), exported on first use."""
    if not (SMOLLM2 / "model.onnx").is_file():
        from surgery.files.export import export

        export("smollm2-135m", SMOLLM2)
    return SMOLLM2


def smollm2_genai(precision: str = "fp32") -> Path:
    """SmolLM2-135M built by the ONNX Runtime GenAI model builder (`-p PRECISION -e cpu`) from the same GGUF weights, made
    on first use under out/ (the HF folder transformers saves, with the export's tokenizer files beside it)."""
    folder = ROOT / "out" / f"smollm2-genai-{precision}"
    if (folder / "model.onnx").is_file():
        return folder
    hf = ROOT / "out" / "smollm2-hf"
    if not (hf / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM

        from surgery.files.export import resolve_source

        src = resolve_source("smollm2-135m")
        AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32).save_pretrained(hf)
        for item in smollm2().iterdir():
            if item.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy2(item, hf / item.name)
    from graphs.deployed import genai_build

    return genai_build(hf, folder, precision)


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `rows` (already formatted strings; a cell a row lacks is left blank)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def gpu_name() -> str:
    """The GPU's name and driver, from nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "GPU name unknown (no nvidia-smi)"
    except (OSError, subprocess.TimeoutExpired):
        return "GPU name unknown (no nvidia-smi)"


# The synthetic decoder of the GPU suite.
# Llama-3.2-1B's and Llama-3-8B's shapes with a 32k vocabulary: 1.1 B and 7.0 B parameters (2.2 and 14 GB in float16)
SHAPES = {
    "1b": {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_mlp": 8192, "vocab": 32000, "max_positions": 2048},
    "8b": {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "d_mlp": 14336, "vocab": 32000, "max_positions": 2048},
}
TINY = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128, vocab=512, max_positions=256)
SMOLLM2_LAYERS = "4,6-8,15,22-23,25,28-29"
WAYS = ("ORT", "ORT + CUDA graphs")  # as ORT runs each node, and captured once as a CUDA graph and replayed  # what `surgery parallelize out/smollm2` chose before issue 18's KL budget


def llama_shaped(d_model, n_layers, n_heads, n_kv_heads, d_mlp, vocab, max_positions, dtype="float32", seed=0) -> ir.Model:
    """A Llama-shaped decoder with random weights and a KV cache, in the form `surgery export` gives:
    inputs input_ids, attention_mask, position_ids, past_key_values.N.key/value; outputs logits,
    present.N.key/value. Decomposed RMSNorm, rotary positions, grouped-query attention, SiLU-gated mlp."""
    rng = np.random.default_rng(seed)
    d_head, rep = d_model // n_heads, n_heads // n_kv_heads
    nodes, inits, inputs, outputs = [], [], [], []
    ft = np.dtype(dtype)  # the weights', activations' and KV cache's type
    fx, i64 = ir.DataType.from_numpy(ft), ir.DataType.INT64

    made: dict[str, ir.Value] = {}

    def const(name, array):
        if name not in made:
            tensor = ir.tensor(array, name=name)
            made[name] = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor)
            inits.append(made[name])
        return made[name]

    def weight(name, *shape, std=0.02):
        return const(name, (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(ft))

    def op(op_type, *args, name=None, **attrs):
        node = ir.node(op_type, list(args), attributes=attrs, name=name or f"n{len(nodes)}/{op_type}")
        node.outputs[0].name = node.name
        nodes.append(node)
        return node.outputs[0]

    def graph_input(name, dtype, dims):
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))
        inputs.append(value)
        return value

    def graph_output(value, name, dtype, dims):
        value.name, value.type, value.shape = name, ir.TensorType(dtype), ir.Shape(dims)
        outputs.append(value)

    two, eps = const("two", np.array(2.0, ft)), const("eps", np.array(1e-5, ft))
    last = const("last_axis", np.array([-1], np.int64))

    def rms(x, layer, which):
        mean = op("ReduceMean", op("Pow", x, two), last, keepdims=1)
        return op("Mul", op("Mul", x, op("Reciprocal", op("Sqrt", op("Add", mean, eps)))), const(f"{which}.{layer}", np.ones(d_model, ft)))

    ids = graph_input("input_ids", i64, ["batch", "sequence_length"])
    mask = graph_input("attention_mask", i64, ["batch", "total_length"])
    positions = graph_input("position_ids", i64, ["batch", "sequence_length"])
    # rotary tables [max_positions, d_head] read at position_ids: [batch, 1, seq, d_head]
    angles = np.outer(np.arange(max_positions), 10000.0 ** (-np.arange(0, d_head, 2) / d_head))
    angles = np.concatenate([angles, angles], axis=1)
    one_axis = const("axis_1", np.array([1], np.int64))
    cos = op("Unsqueeze", op("Gather", const("rope.cos", np.cos(angles).astype(ft)), positions), one_axis)
    sin = op("Unsqueeze", op("Gather", const("rope.sin", np.sin(angles).astype(ft)), positions), one_axis)
    # additive mask [batch, 1, seq, total]: key j is seen by query i when pos(j) <= pos(i) and mask[j] = 1
    key_pos = op("Sub", op("CumSum", mask, const("axis_1s", np.array(1, np.int64))), const("one", np.array(1, np.int64)))
    axis_2 = const("axis_2", np.array([2], np.int64))
    causal = op("LessOrEqual", op("Unsqueeze", key_pos, one_axis), op("Unsqueeze", positions, axis_2))
    seen = op("And", causal, op("Cast", op("Unsqueeze", mask, one_axis), to=ir.DataType.BOOL))
    bias = op("Unsqueeze", op("Where", seen, const("zero", np.array(0.0, ft)), const("neg", np.array(-1e4 if ft == np.float16 else -1e9, ft))), one_axis)
    half = const("halves", np.array([d_head // 2, d_head // 2], np.int64))
    scale = const("scale", np.array(d_head**-0.5, ft))

    def heads(x, n):  # [batch, seq, n * d_head] -> [batch, n, seq, d_head]
        return op("Transpose", op("Reshape", x, const(f"heads_shape.{n}", np.array([0, 0, n, d_head], np.int64))), perm=[0, 2, 1, 3])

    def rotate(x):  # x * cos + rotate_half(x) * sin, x [batch, heads, seq, d_head]
        split = ir.node("Split", [x, half], attributes={"axis": -1}, num_outputs=2, name=f"n{len(nodes)}/Split")
        nodes.append(split)
        x1, x2 = split.outputs
        x1.name, x2.name = f"{split.name}/0", f"{split.name}/1"
        return op("Add", op("Mul", x, cos), op("Mul", op("Concat", op("Neg", x2), x1, axis=-1), sin))

    x = op("Gather", weight("embed_tokens", vocab, d_model), ids, name="embed")
    for l in range(n_layers):
        a = rms(x, l, "ln1")
        q = rotate(heads(op("MatMul", a, weight(f"q.{l}", d_model, d_model)), n_heads))
        k = rotate(heads(op("MatMul", a, weight(f"k.{l}", d_model, n_kv_heads * d_head)), n_kv_heads))
        v = heads(op("MatMul", a, weight(f"v.{l}", d_model, n_kv_heads * d_head)), n_kv_heads)
        kv_dims = ["batch", n_kv_heads, "past_sequence_length", d_head]
        k = op("Concat", graph_input(f"past_key_values.{l}.key", fx, kv_dims), k, axis=2)
        v = op("Concat", graph_input(f"past_key_values.{l}.value", fx, kv_dims), v, axis=2)
        graph_output(k, f"present.{l}.key", fx, ["batch", n_kv_heads, "total_length", d_head])
        graph_output(v, f"present.{l}.value", fx, ["batch", n_kv_heads, "total_length", d_head])
        if rep > 1:  # grouped-query attention: each kv head serves `rep` query heads
            repeat, merged = const("repeat", np.array([1, 1, rep, 1, 1], np.int64)), const("merged", np.array([0, n_heads, -1, d_head], np.int64))
            k, v = (op("Reshape", op("Expand", op("Unsqueeze", t, axis_2), repeat), merged) for t in (k, v))
        scores = op("Add", op("Mul", op("MatMul", q, op("Transpose", k, perm=[0, 1, 3, 2])), scale), bias)
        mixed = op("MatMul", op("Softmax", scores, axis=-1), v)
        merged_heads = op("Reshape", op("Transpose", mixed, perm=[0, 2, 1, 3]), const("model_shape", np.array([0, 0, d_model], np.int64)))
        h = op("Add", x, op("MatMul", merged_heads, weight(f"o.{l}", d_model, d_model), name=f"blocks.{l}.attn_out"), name=f"blocks.{l}.resid_mid")
        m = rms(h, l, "ln2")
        gate = op("MatMul", m, weight(f"gate.{l}", d_model, d_mlp))
        up = op("MatMul", m, weight(f"up.{l}", d_model, d_mlp))
        act = op("Mul", op("Mul", gate, op("Sigmoid", gate)), up)
        x = op("Add", h, op("MatMul", act, weight(f"down.{l}", d_mlp, d_model), name=f"blocks.{l}.mlp_out"), name=f"blocks.{l}.resid_post")
    logits = op("MatMul", rms(x, 0, "ln_f"), weight("lm_head", d_model, vocab))
    graph_output(logits, "logits", fx, ["batch", "sequence_length", vocab])
    outputs.insert(0, outputs.pop())
    g = ir.Graph(inputs, outputs, nodes=nodes, initializers=inits, opset_imports={"": 18}, name="llama_shaped")
    return ir.Model(g, ir_version=9, producer_name="benchmarks/common.py")


def written(folder: Path, shape: dict) -> Path:
    """The Llama-shaped model of `shape`, written once to `folder` (external data past 1 GB); rebuilt when the shape changes."""
    config = folder / "config.json"
    if not (config.is_file() and json.loads(config.read_text()) == shape and (folder / graph.MODEL_FILE).is_file()):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        graph.save(llama_shaped(**shape), folder / graph.MODEL_FILE)
        config.write_text(json.dumps(shape))
    return folder


def random_fixes(d_model: int, layers, seed: int = 0) -> dict[int, Fix]:
    """Small random fixes of the fitted form (full w_a, w_p and b) for a model whose fit would mean nothing."""
    rng = np.random.default_rng(seed)
    small = lambda *shape: rng.normal(0, 1e-3, shape)  # noqa: E731
    return {l: Fix(w_a=small(d_model, d_model), w_p=small(d_model, d_model), b=small(d_model)) for l in layers}


def block_sets(spec: str, n_blocks: int) -> list[list[int]]:
    """--synthetic-layers: `;`-separated sets, each `half` (the later half of the blocks), `all` or a layer list."""
    later_half = ",".join(map(str, range(n_blocks // 2, n_blocks)))
    return [parse_layers(later_half if item.strip() == "half" else item.strip(), n_blocks) for item in spec.split(";")]
