"""What surgery knows about ops beyond plain ONNX, as tables, and the plain view of a graph they give.

Deployed graphs (the ONNX Runtime GenAI model builder's, the ORT transformers optimizer's) fuse each
residual add into the normalisation after it:

    SkipSimplifiedLayerNormalization(input, skip, scale[, bias]) -> (rmsnorm(input + skip + bias) * scale, -, -, sum)

`unfuse` splits every such op into its Add and its normalisation, so that find_blocks and every pass
see the residual stream as Adds, as in an optimum export; `refuse` joins each normalisation that came
from one back to the Add it reads, so a rewritten graph is written with the input's own ops. Every op
a block may hold outside the standard ONNX domain must be in KNOWN: an op the table does not describe
could hide a residual add or a mix of tokens, so find_blocks refuses it by name.
"""

from __future__ import annotations

import dataclasses
import json

import onnx_ir as ir

MS = "com.microsoft"
STANDARD_DOMAINS = ("", "ai.onnx")
UNFUSED_KEY = "surgery.unfused"  # node metadata: JSON {"op", "name", "role"[, "epsilon"]} of the fused op it was split from


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
# Projections by a weight: op -> the input index of the weight. Only "MatMul" and "Gemm" hold it as plain floats.
PROJECTIONS = {"MatMul": 1, "Gemm": 1, "FusedMatMul": 1, "MatMulNBits": 1, "MatMulInteger": 1, "DynamicQuantizeMatMul": 1,
               "MatMulIntegerToFloat": 1}
# Quantizers: op -> the input whose values its output 0 carries; its other inputs and outputs are scales and
# zero points (onnxruntime.quantization's dynamic int8 and QDQ graphs).
QUANTIZERS = {"DynamicQuantizeLinear": 0, "QuantizeLinear": 0, "DequantizeLinear": 0}
QUANTIZED = frozenset({"MatMulNBits", "GatherBlockQuantized"})
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


def unfused_from(node: ir.Node) -> str | None:
    """The fused op `node` was split from by `unfuse`, if it was."""
    raw = node.metadata_props.get(UNFUSED_KEY)
    return json.loads(raw)["op"] if raw else None


def unfuse(model: ir.Model) -> int:
    """Split every Skip(Simplified)LayerNormalization whose mean and inverse-std outputs nobody reads into
    [bias Add,] Add and the plain normalisation, in place. Returns how many were split.

    The sum keeps the name of the op's output 3 when the graph exposes it (else `NAME/sum`), the
    normalised value keeps output 0's; the bias is added to the branch operand, the one that is not
    the residual stream (the other operand is computed from the stream, not the reverse).
    """
    graph = model.graph
    count = 0
    for node in list(graph):
        spec = SKIP_NORMS.get(node.op_type) if node.domain == MS else None
        if spec is None or any(_read(out) for out in node.outputs[1 : spec.sum_output]):
            continue
        eps = node.attributes.get("epsilon")
        tag = lambda role, **more: json.dumps({"op": node.op_type, "name": node.name, "role": role, **more})  # noqa: E731
        a, b = node.inputs[0], node.inputs[1]
        new = []
        bias = _input(node, spec.bias)
        if bias is not None:
            branch_first = not _computed_from(b, a)  # a is the branch unless b is computed from a
            target = a if branch_first else b
            add_bias = ir.node("Add", [target, bias], name=f"{node.name}/bias", metadata_props={UNFUSED_KEY: tag("bias")})
            add_bias.outputs[0].name = f"{node.name}/bias"
            new.append(add_bias)
            a, b = (add_bias.outputs[0], b) if branch_first else (a, add_bias.outputs[0])
        add = ir.node("Add", [a, b], name=f"{node.name}/add", metadata_props={UNFUSED_KEY: tag("sum")})
        add.outputs[0].name = f"{node.name}/sum"
        norm_inputs = [add.outputs[0], node.inputs[spec.scale]]
        if spec.beta is not None and _input(node, spec.beta) is not None:
            norm_inputs.append(node.inputs[spec.beta])
        norm = ir.node(  # computes with the fused op's epsilon; `epsilon` says whether the op stated it
            spec.norm, norm_inputs, name=f"{node.name}/norm", metadata_props={UNFUSED_KEY: tag("norm", epsilon=eps is not None)},
            attributes={"axis": -1, "epsilon": float(eps.value) if eps is not None else spec.epsilon, "stash_type": 1},
        )
        new += [add, norm]
        old_values, new_values = [node.outputs[0]], [norm.outputs[0]]
        if len(node.outputs) > spec.sum_output and node.outputs[spec.sum_output].name:
            old_values.append(node.outputs[spec.sum_output])
            new_values.append(add.outputs[0])
        for value in node.outputs[1:]:
            if value not in old_values:
                value.name = None
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, old_values, new_values)
        count += 1
    return count


def refuse(model: ir.Model) -> int:
    """The inverse of `unfuse`, in place, for whatever passes did in between: each normalisation split
    from a fused op that reads a sum split from one becomes that fused op again (output 3 carries the sum
    when something else reads it). Two such normalisations reading one sum (a parallel block's ln1 and
    ln2) each become a fused op, the sum computed twice. Returns how many fused ops it wrote."""
    graph = model.graph
    count = 0
    for add in [n for n in graph if _role(n) == "sum"]:
        total = add.outputs[0]
        norms = [user for user, index in total.uses() if index == 0 and _role(user) == "norm" and user.op_type in _FUSED_FORM]
        if not norms:
            continue
        others = [user for user, _ in total.uses() if user not in norms]
        a, b, bias_node = add.inputs[0], add.inputs[1], None
        for i, operand in enumerate((a, b)):
            producer = operand.producer() if operand is not None else None
            if producer is not None and _role(producer) == "bias" and len(operand.uses()) == 1 and not operand.is_graph_output():
                bias_node = producer
                a, b = (producer.inputs[0], b) if i == 0 else (a, producer.inputs[0])
                break
        keeper = norms[0] if (others or total.is_graph_output()) else None
        for norm in norms:
            op = _FUSED_FORM[norm.op_type]
            spec = SKIP_NORMS[op]
            inputs: list[ir.Value | None] = [a, b, norm.inputs[1]]
            if spec.beta is not None:
                inputs.append(norm.inputs[2] if len(norm.inputs) > 2 else None)
            if bias_node is not None:
                inputs += [None] * (spec.bias - len(inputs)) + [bias_node.inputs[1]]
            origin = json.loads(norm.metadata_props[UNFUSED_KEY])
            eps = float(norm.attributes["epsilon"].value)
            stated = origin.get("epsilon", True) or eps != spec.epsilon  # written back as read: absent when it was
            fused = ir.node(
                op, inputs, domain=MS, num_outputs=spec.sum_output + 1 if norm is keeper else 1,
                name=origin["name"] + ("" if norm is norms[0] else f"/{len(norms)}"),
                attributes={"epsilon": eps} if stated else {},
            )
            old_values, new_values = [norm.outputs[0]], [fused.outputs[0]]
            if norm is keeper:
                old_values.append(total)
                new_values.append(fused.outputs[spec.sum_output])
            ir.convenience.replace_nodes_and_values(graph, norm, [norm], [fused], old_values, new_values)
            count += 1
        if not total.uses() and not total.is_graph_output():
            graph.remove(add, safe=True)
            if bias_node is not None and not bias_node.outputs[0].uses():
                graph.remove(bias_node, safe=True)
    if count:
        _import(model, MS)
        graph.sort()
    for node in graph:
        node.metadata_props.pop(UNFUSED_KEY, None)
    return count


def split_shared_sums(model: ir.Model, moved_by: str = "parallelize") -> int:
    """Where a pass made a normalisation read a residual sum that another normalisation reads too (a
    parallel block's ln2 reading resid_pre = the sum ln1 reads), give it its own copy of the Add, in place.

    ONNX Runtime fuses an Add into the one normalisation after it (SkipLayerNormalization) only when no
    other normalisation reads the sum; with a copy, both fuse. The copy adds its operands in the other
    order, so common-subexpression elimination does not merge it back; `merge_repeated_sums` does, on load.
    The nodes rewired by the pass carry the metadata surgery.pass == `moved_by`. Returns the copies made."""
    graph = model.graph
    copies: dict[tuple[ir.Value, str], ir.Value] = {}
    for node in list(graph):
        if node.metadata_props.get("surgery.pass") != moved_by:
            continue
        layer = node.metadata_props.get("surgery.layer", "")
        for index, value in enumerate(node.inputs):
            add = value.producer() if value is not None else None
            if add is None or add.op_type != "Add" or len(add.inputs) != 2 or any(x is None or x.const_value is not None for x in add.inputs):
                continue
            if all(user.metadata_props.get("surgery.pass") == moved_by for user, _ in value.uses()):
                continue  # nothing else reads the sum: no fusion is lost
            if (value, layer) not in copies:
                copy = ir.node("Add", [add.inputs[1], add.inputs[0]], name=f"{add.name}/copy_for_blocks.{layer}")
                copy.outputs[0].name = f"{value.name}/copy_for_blocks.{layer}"
                copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
                graph.insert_after(add, [copy])
                copies[(value, layer)] = copy.outputs[0]
            node.replace_input_with(index, copies[(value, layer)])
    return len(copies)


def merge_repeated_sums(model: ir.Model) -> int:
    """Read every Add of two computed values that an earlier Add already computes (in either operand
    order) as that earlier sum, in place: a residual sum recomputed for a second normalisation
    (`split_shared_sums`, or two fused norms after the ORT optimizer) is one stream value. Returns how many."""
    graph = model.graph
    first: dict[frozenset, ir.Value] = {}
    merged = 0
    for node in list(graph):
        if node.op_type != "Add" or node.domain not in STANDARD_DOMAINS or len(node.inputs) != 2 or None in node.inputs:
            continue
        if node.inputs[0] is node.inputs[1] or any(x.const_value is not None for x in node.inputs):
            continue
        key = frozenset(node.inputs)
        if key not in first:
            first[key] = node.outputs[0]
        elif not node.outputs[0].is_graph_output():
            ir.convenience.replace_all_uses_with(node.outputs[0], first[key])
            graph.remove(node, safe=True)
            merged += 1
    return merged


_FUSED_FORM = {spec.norm: op for op, spec in SKIP_NORMS.items()}


def _role(node: ir.Node) -> str | None:
    raw = node.metadata_props.get(UNFUSED_KEY)
    return json.loads(raw)["role"] if raw else None


def _input(node: ir.Node, index: int | None) -> ir.Value | None:
    return node.inputs[index] if index is not None and index < len(node.inputs) else None


def _read(value: ir.Value) -> bool:
    return bool(value.name) and (bool(value.uses()) or value.is_graph_output())


def _computed_from(value: ir.Value | None, source: ir.Value | None) -> bool:
    """True when `value` is computed from `source` (walks producers back from `value`)."""
    seen: set[ir.Node] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        if v is None:
            continue
        if v is source:
            return True
        node = v.producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(node.inputs)
    return False


def _import(model: ir.Model, domain: str) -> None:
    model.opset_imports.setdefault(domain, 1)
