"""What surgery knows about ops beyond plain ONNX, as tables.

Deployed graphs (the ONNX Runtime GenAI model builder's, the ORT transformers optimizer's) fuse each
residual add into the normalisation after it:

    SkipSimplifiedLayerNormalization(input, skip, scale[, bias]) -> (rmsnorm(input + skip + bias) * scale, -, -, sum)

SKIP_NORMS says which input is what, so that surgery.files.canonical can split such ops on load and join them
again on save. Every op a block may hold outside the standard ONNX domain must be in KNOWN: an op the
table does not describe could hide a residual add or a mix of tokens, so find_blocks refuses it by name.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

MS = "com.microsoft"
STANDARD_DOMAINS = ("", "ai.onnx")


@dataclasses.dataclass(frozen=True)
class SkipNorm:
    """A normalisation with the residual add fused in: which inputs mean what, and its plain form."""

    norm: str  # the plain normalisation op, default domain
    scale: int
    beta: int | None  # LayerNorm's additive bias
    bias: int | None  # added to the sum (the branch's output bias, folded in by the fusion)
    sum_output: int = 3
    epsilon: float = 1e-12  # ONNX Runtime's schema default, when the node has no epsilon attribute


SKIP_NORMS = {
    "SkipSimplifiedLayerNormalization": SkipNorm("SimplifiedLayerNormalization", scale=2, beta=None, bias=3),
    "SkipLayerNormalization": SkipNorm("LayerNormalization", scale=2, beta=3, bias=4),
}
# Normalisations as one op: op -> the kind find_blocks reports.
NORMS = {
    "LayerNormalization": "LayerNorm",
    "RMSNormalization": "RMSNorm",
    "SimplifiedLayerNormalization": "RMSNorm",
}
# The epsilon each normalisation op computes with when it has no epsilon attribute (the op schemas' defaults).
EPSILON = {op: 1e-5 for op in NORMS} | {op: spec.epsilon for op, spec in SKIP_NORMS.items()}
# Ops that mix tokens: a branch holding one is attention.
ATTENTION = frozenset(
    {"Softmax", "Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedMultiHeadAttention", "PagedAttention",
     "SparseAttention", "DecoderMaskedMultiHeadAttention"}
)
# Attention ops that take a chunk of several tokens after a KV cache for one sequence at a time only (ORT's CPU
# GroupQueryAttention: "batch_size must be 1 when sequence_length > 1 and past context is given").
ONE_ROW_AFTER_PAST = frozenset({"GroupQueryAttention"})
# Projections by a weight: op -> the input index of the weight. Only "MatMul" and "Gemm" hold it as plain floats.
PROJECTIONS = {"MatMul": 1, "Gemm": 1, "FusedMatMul": 1, "MatMulNBits": 1, "MatMulInteger": 1, "DynamicQuantizeMatMul": 1,
               "MatMulIntegerToFloat": 1}
# Quantizers: op -> the input whose values its output 0 carries; its other inputs and outputs are scales and
# zero points (onnxruntime.quantization's dynamic int8 and QDQ graphs).
QUANTIZERS = {"DynamicQuantizeLinear": 0, "QuantizeLinear": 0, "DequantizeLinear": 0}
# Token embeddings: op -> (table input, input whose float type is the stream's).
EMBEDDINGS = {"Gather": (0, 0), "GatherBlockQuantized": (0, 2)}
# Contrib ops that act on each token alone and add nothing to the residual stream: activations,
# rotary embeddings, bias adds. With the tables above, what a block may hold outside the standard domain.
PER_TOKEN = frozenset(
    {"QuickGelu", "FastGelu", "BiasGelu", "Gelu", "BiasAdd", "RotaryEmbedding", "GemmFastGelu", "FusedConv"}
)
# Ops through which a value computed only from constants is still a constant (a weight).
WEIGHT_PASSTHROUGH = frozenset({"Transpose", "Cast", "Reshape", "Identity", "Unsqueeze", "Squeeze", "Flatten"})
KNOWN = frozenset(SKIP_NORMS) | frozenset(NORMS) | ATTENTION | frozenset(PROJECTIONS) | frozenset(EMBEDDINGS) | PER_TOKEN


def is_weight(value: ir.Value | None, depth: int = 4) -> bool:
    """True when `value` is an initializer or Constant, maybe transposed, cast or reshaped (`depth` ops at most)."""
    if value is None:
        return False
    if value.const_value is not None or value.is_initializer():
        return True
    node = value.producer()
    if node is None:
        return False
    if node.op_type == "Constant":
        return True
    return node.op_type in WEIGHT_PASSTHROUGH and depth > 0 and is_weight(node.inputs[0], depth - 1)


def is_known(node: ir.Node) -> bool:
    return node.domain in STANDARD_DOMAINS or node.op_type in KNOWN


def describe(node: ir.Node) -> str:
    """`GroupQueryAttention (com.microsoft)`, or the op alone in the standard domain."""
    return node.op_type if node.domain in STANDARD_DOMAINS else f"{node.op_type} ({node.domain})"

# ONNX Runtime's names of the float tensor types (NodeArg.type) -> their element type; numpy has no bfloat16, so a
# bfloat16 input is fed as an OrtValue (runtime.feeds), and ORT's CPU provider has no bfloat16 kernels for most ops.
ORT_FLOATS = {
    "tensor(float)": ir.DataType.FLOAT,
    "tensor(float16)": ir.DataType.FLOAT16,
    "tensor(bfloat16)": ir.DataType.BFLOAT16,
    "tensor(double)": ir.DataType.DOUBLE,
}
