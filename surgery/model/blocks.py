"""find_blocks(model) -> list[BlockMap]: where each transformer block lives in an exported graph.

This is the only code that knows what a block looks like. It reads structure, never names:

1. Every normalisation is found by its shape: a fused LayerNormalization / RMSNormalization op, or a ReduceMean over the last axis of x**2 (RMSNorm) or of
   (x - mean(x))**2 (LayerNorm). The values the normalisations read are the candidate residual-stream values.
2. From the value the final normalisation reads, the stream is walked backwards: each stream value is a sum (a tree of Adds of two computed operands) of the
   previous stream value and one or two branch outputs. A bias Add has a constant operand, so it ends a branch, not a sum.
3. A branch that reaches a Softmax (or a fused attention op) is attention, any other is the mlp. Attention then mlp in consecutive steps is a sequential
   block; both in one step is parallel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal

import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.files import canonical, metadata, ops
from surgery.model.nodes import values_by_name

ATTENTION_OPS = ops.ATTENTION
Branch = Literal["attn", "mlp"]  # the two branches of a block


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """Where block `layer` (from 0) lives in the graph, by value name: each name is a key of `Subject.values`.

    resid_pre is the stream the block reads and resid_post the stream it writes; attn_out and mlp_out are the branch outputs its residual adds read (a
    fused block's both name their sum); resid_mid, the sum of resid_pre and attn_out, is None in a parallel block; mlp_in is what ln2 reads (resid_mid,
    or resid_pre when parallel). ln_kind and mlp_kind say what the normalisation and the mlp are; fix is what `compensate` folded into the output
    projections (None: nothing); post_norm: the branch outputs are normalised before the residual add (Gemma 2, OLMo 2)."""

    layer: int
    resid_pre: str
    attn_out: str
    resid_mid: str | None  # None in a parallel block
    mlp_in: str  # the value ln2 reads (resid_mid, or resid_pre when parallel)
    mlp_out: str
    resid_post: str
    ln_kind: str  # e.g. "RMSNorm (decomposed)", "LayerNorm (fused op)"
    mlp_kind: str  # "gated" (act(x W_gate) * x W_up), "plain" (act(x W_in)), or "fused"
    fused: bool = False  # one MatMul computes attn_out + mlp_out; both fields name that sum
    fix: str | None = None  # a fix folded into the output projections by `compensate` (what it is)
    post_norm: bool = False  # the branch outputs are normalised before the residual add (Gemma 2, OLMo 2)

    @property
    def is_parallel(self) -> bool:
        """ln2 reads resid_pre (there is no resid_mid): a parallel or a fused block."""
        return self.resid_mid is None

    def output(self, branch: Branch) -> str:
        """The value the residual add of `branch` reads: attn_out or mlp_out."""
        return self.mlp_out if branch == "mlp" else self.attn_out

    @property
    def form(self) -> str:
        """`sequential`, `parallel` or `fused`."""
        return "fused" if self.fused else "parallel" if self.is_parallel else "sequential"

    def tensors(self) -> dict[str, str]:
        """The block's residual tensors, name -> graph value name (resid_mid omitted when parallel;
        a fused block has no separate attn_out and mlp_out)."""
        if self.fused:
            return {"resid_pre": self.resid_pre, "resid_post": self.resid_post}
        names = {
            "resid_pre": self.resid_pre,
            "attn_out": self.attn_out,
            "resid_mid": self.resid_mid,
            "mlp_out": self.mlp_out,
            "resid_post": self.resid_post,
        }
        return {k: v for k, v in names.items() if v is not None}


def find_blocks(model: ir.Model, where: str = "the graph") -> list[BlockMap]:
    """Find every transformer block of a decoder graph, in order, from the graph's structure alone.

    Args:
        model: the exported decoder.
        where: how error messages name the model (usually its path).

    Returns:
        One BlockMap per block, block i at index i.

    Raises:
        SurgeryError: the graph is not a decoder made of residual attention and mlp blocks, or a block holds an op that
            surgery/files/ops.py does not describe (it could hide a residual add); one line naming `where`.
    """
    graph = model.graph
    order = {node: i for i, node in enumerate(graph)}
    is_const = _ConstantTest()
    norms = _find_norms(graph)
    if not norms:
        raise SurgeryError(
            f"found no transformer blocks in {where}: it has no LayerNorm or RMSNorm "
            f"(ops: {_op_summary(graph)}); export a decoder LM with `surgery export`"
        )

    # Walk the residual stream backwards from the value the last normalisation reads. Each stream
    # value is a sum; the previous stream value is the term every other term is computed from.
    current = max(norms, key=lambda v: _position(v, order))
    steps: list[tuple[ir.Value, ir.Value, list[ir.Value]]] = []  # (prev stream value, next, branch outputs)
    while True:
        terms = _sum_terms(current, is_const)
        skip = _skip(terms, order)
        if skip is None:
            break
        steps.append((_strip_casts(skip), current, [t for t in terms if t is not skip]))
        current = _strip_casts(skip)
    steps.reverse()
    if not steps:
        raise SurgeryError(
            f"found no transformer blocks in {where}: {len(norms)} normalisation input(s) "
            f"but no residual Add around them (ops: {_op_summary(graph)}); export a decoder LM with `surgery export`"
        )
    blocks = _read_blocks(steps, norms, where)
    _check_ops(model, blocks, where)
    return blocks


def _read_blocks(steps: list[tuple[ir.Value, ir.Value, list[ir.Value]]], norms: dict[ir.Value, list[str]], where: str) -> list[BlockMap]:
    """The blocks of the residual stream's steps (prev stream value, next, branch outputs), in order: attention then mlp in consecutive steps is a sequential
    block, both in one step a parallel one, and one branch that `surgery parallelize --fuse` wrote a fused block."""
    stream = {v for pre, post, _ in steps for v in (pre, post)}
    blocks: list[BlockMap] = []
    i = 0
    while i < len(steps):
        pre, post, branches = steps[i]
        kinds = [_branch_kind(b, pre, stream) for b in branches]
        if sorted(kinds) == ["attn", "mlp"]:
            attn, mlp = (branches if kinds[0] == "attn" else branches[::-1])
            blocks.append(_block(len(blocks), pre, attn, None, pre, mlp, post, norms, stream))
            i += 1
            continue
        if kinds == ["attn"]:
            mid, post2, branches2 = steps[i + 1] if i + 1 < len(steps) else (None, None, [])
            if [_branch_kind(b, mid, stream) for b in branches2] == ["mlp"]:
                blocks.append(
                    _block(len(blocks), pre, branches[0], mid, mid, branches2[0], post2, norms, stream)
                )
                i += 2
                continue
            if any(metadata.made_by(n) == metadata.FUSE for n in _branch_nodes(branches[0], stream)):
                # `surgery parallelize --fuse` wrote one branch that is attention and mlp at once
                blocks.append(
                    dataclasses.replace(
                        _block(len(blocks), pre, branches[0], None, pre, branches[0], post, norms, stream),
                        mlp_kind="fused", fused=True,
                    )
                )
                i += 1
                continue
        found = " + ".join(f"{k} ({b.name})" for k, b in zip(kinds, branches)) or "nothing"
        raise SurgeryError(
            f"cannot read block {len(blocks)} of {where}: the residual add at {post.name!r} "
            f"adds {found} to {pre.name!r}; expected attention then mlp (sequential) or both at once (parallel)"
        )
    return blocks


def _check_ops(model: ir.Model, blocks: list[BlockMap], where: str) -> None:
    """Refuse a block whose branches hold an op the op table does not describe: it could hide a residual add."""
    values = values_by_name(model)
    for block in blocks:
        for branch in ("attn", "mlp"):
            unknown = sorted({ops.describe(n) for n in branch_nodes(model, block, branch, values) if not ops.is_known(n)})
            if unknown:
                raise SurgeryError(
                    f"block {block.layer} of {where} holds {', '.join(unknown)} in its {branch} branch, an op surgery's op "
                    "table (surgery/files/ops.py) does not describe; it could hide a residual add, so nothing is rewritten"
                )


def branch_nodes(model: ir.Model, block: BlockMap, branch: Branch, values: dict[str, ir.Value] | None = None) -> set[ir.Node]:
    """Nodes computing the block's `attn_out` or `mlp_out` (its ln included), back to the stream values it reads.
    values: the model's values_by_name, when the caller has it (else it is made: a scan of the whole graph)."""
    values = values if values is not None else values_by_name(model)
    stop = {values[name] for name in (block.resid_pre, block.resid_mid) if name is not None}
    return _branch_nodes(values[block.output(branch)], stop)


@dataclasses.dataclass(frozen=True)
class Norm:
    """A normalisation reading a block's stream value: out = normalize(x) * scale (+ bias)."""

    kind: str  # "LayerNorm" or "RMSNorm"
    input: str
    output: str  # the value the projections read
    scale: str  # 1-D initializer [d_model]
    bias: str | None
    eps: float | None  # None: a decomposed RMSNorm whose epsilon is not one constant


def block_norms(model: ir.Model, block: BlockMap, values: dict[str, ir.Value] | None = None) -> tuple[Norm, Norm]:
    """ln1 and ln2 of a block, with their scale, bias and epsilon, for passes that fold them (values: as branch_nodes);
    raises SurgeryError for normalisations it cannot read (decomposed LayerNorm, say)."""
    values = values if values is not None else values_by_name(model)
    attn = _branch_nodes(values[block.attn_out], {values[block.resid_pre]})
    mlp = _branch_nodes(values[block.mlp_out], {values[n] for n in (block.resid_pre, block.resid_mid) if n})
    found = {}
    for which, source, branch in (("ln1", values[block.resid_pre], attn), ("ln2", values[block.mlp_in], mlp)):
        norms = [n for n in _norm_nodes(source) if n in branch]
        if len(norms) != 1:
            raise SurgeryError(f"block {block.layer}: found {len(norms)} normalisations for {which} reading {source.name!r}; expected one")
        found[which] = _read_norm(norms[0], source, block.layer, which)
    return found["ln1"], found["ln2"]


def _norm_nodes(x: ir.Value) -> list[ir.Node]:
    """The LayerNormalization / RMSNormalization / ReduceMean(x**2) nodes that normalise x."""
    out = []
    for node in _consumers_through_casts(x):
        if node.op_type in ops.NORMS:
            out.append(node)
        elif node.op_type in ("Pow", "Mul") and _squared(node) is x:
            out.extend(u for u, _ in node.outputs[0].uses() if u.op_type == "ReduceMean")
    return out


def _consumers_through_casts(x: ir.Value) -> list[ir.Node]:
    nodes, todo = [], [x]
    while todo:
        for user, _ in todo.pop().uses():
            if user.op_type in ("Cast", "Identity"):
                todo.append(user.outputs[0])
            else:
                nodes.append(user)
    return nodes


def _read_norm(node: ir.Node, x: ir.Value, layer: int, which: str) -> Norm:
    if node.op_type in ops.NORMS:
        kind = ops.NORMS[node.op_type]
        attr = node.attributes.get("epsilon")
        bias = node.inputs[2].name if kind == "LayerNorm" and len(node.inputs) > 2 and node.inputs[2] is not None else None
        return Norm(kind, x.name, node.outputs[0].name, node.inputs[1].name, bias, float(attr.value) if attr else ops.EPSILON[node.op_type])
    # Decomposed RMSNorm: ReduceMean -> Add(eps) -> Sqrt -> Div(1, .) | Reciprocal -> Mul(x, .) -> [Cast] -> Mul(scale, .)
    value, eps = node.outputs[0], None
    for _ in range(8):
        uses = value.uses()
        if len(uses) != 1:
            break
        user = uses[0].node
        if user.op_type == "Add" and eps is None:
            const = next((_constant_tensor(v) for v in user.inputs if v is not None and _constant_tensor(v) is not None), None)
            eps = None if const is None else float(const.numpy().reshape(-1)[0])
        if user.op_type == "Mul":
            scale = next((v for v in user.inputs if v is not None and v.const_value is not None and v.shape is not None and v.shape.rank() == 1), None)
            if scale is not None:
                return Norm("RMSNorm", x.name, user.outputs[0].name, scale.name, None, eps)
        value = user.outputs[0]
    raise SurgeryError(f"block {layer}: cannot read the scale of {which} (RMSNorm reading {x.name!r}); this graph shape is not supported for --fuse")


def _block(layer, pre, attn, mid, mlp_in, mlp, post, norms, stream) -> BlockMap:
    ln_kinds = sorted(set(norms.get(pre, []))) or ["none"]
    mlp_nodes = _branch_nodes(mlp, stream)
    fix = next((n.metadata_props[metadata.FIX] for n in mlp_nodes if metadata.FIX in n.metadata_props), None)
    post_norm = any(_normalised(out, norms, stream) for out in (attn, mlp))
    return BlockMap(
        layer=layer,
        resid_pre=pre.name,
        attn_out=attn.name,
        resid_mid=None if mid is None else mid.name,
        mlp_in=mlp_in.name,
        mlp_out=mlp.name,
        resid_post=post.name,
        ln_kind=" / ".join(ln_kinds),
        mlp_kind=_mlp_kind(mlp_nodes, stream),
        fix=fix,
        post_norm=post_norm,
    )


def _mlp_kind(nodes: set[ir.Node], stream: set[ir.Value]) -> str:
    """'gated' when a Mul of the mlp multiplies values computed from two projections, or from two parts (Split outputs, Slices) of one fused gate_up projection:
    act(x W_gate) * (x W_up). 'plain' otherwise: act(x W_in)'s own Muls (GELU's, SiLU's x * sigmoid(x)) read one projection. Quantizers are read through, and a
    quantized projection is one projection (MatMulInteger's Cast and rescale Mul read its output and scales only)."""
    memo: dict[ir.Value, frozenset] = {}

    def projections(value: ir.Value | None) -> frozenset:
        """The projection outputs `value` is computed from, each as (projection node, parts taken of it)."""
        if value is None or value in stream:
            return frozenset()
        if value not in memo:
            node = value.producer()
            if node is None or node.op_type in ("Shape", "Size"):  # a weight, a graph input, or only a shape
                found = frozenset()
            elif node.op_type in ops.PROJECTIONS:
                found = frozenset({(node,)})
            elif node.op_type in ops.QUANTIZERS:  # outputs 1 and 2 of DynamicQuantizeLinear: a scale, a zero point
                found = projections(node.inputs[ops.QUANTIZERS[node.op_type]]) if value is node.outputs[0] else frozenset()
            elif node.op_type in ("Split", "Slice"):  # the part taken: which output, or which Slice node
                part = (node, list(node.outputs).index(value))
                found = frozenset(p + (part,) for p in projections(node.inputs[0]))
            else:
                found = frozenset().union(*(projections(x) for x in node.inputs))
            memo[value] = found
        return memo[value]

    for node in nodes:
        if node.op_type == "Mul" and node.domain in ops.STANDARD_DOMAINS and len(node.inputs) == 2:
            a, b = (projections(x) for x in node.inputs)
            if a and b and a != b:
                return "gated"
    return "plain"


def _normalised(out: ir.Value, norms: dict[ir.Value, list[str]], stream: set[ir.Value]) -> bool:
    """True when the branch output `out` is a normalisation's output: a value a normalisation reads is
    reached from it backwards without crossing a projection (q / k norms inside attention do not count)."""
    seen: set[ir.Node] = set()
    todo = [out]
    while todo:
        value = todo.pop()
        if value in norms and value not in stream:
            return True
        node = value.producer()
        if node is None or node in seen or node.op_type in ops.PROJECTIONS or node.op_type in ATTENTION_OPS:
            continue
        seen.add(node)
        todo.extend(x for x in node.inputs if x is not None and x not in stream)
    return False


def _find_norms(graph: ir.Graph) -> dict[ir.Value, list[str]]:
    """Map each value a normalisation reads to the kinds of normalisation reading it."""
    norms: dict[ir.Value, list[str]] = {}
    for node in graph:
        kind, reads = None, None
        if node.op_type in ops.NORMS and node.domain in (*ops.STANDARD_DOMAINS, ops.MS):
            kind, reads = f"{ops.NORMS[node.op_type]} ({canonical.unfused_from(node) or 'fused op'})", _strip_casts(node.inputs[0])
        elif node.op_type == "ReduceMean" and _reduces_last_axis(node):
            square = _strip_casts(node.inputs[0]).producer()
            base = _squared(square)
            if base is not None:
                centred = base.producer()
                if centred is not None and centred.op_type == "Sub" and _is_mean_of(centred.inputs[1], centred.inputs[0]):
                    kind, reads = "LayerNorm (decomposed)", _strip_casts(centred.inputs[0])
                else:
                    kind, reads = "RMSNorm (decomposed)", base
        if kind is not None and reads is not None:
            norms.setdefault(reads, []).append(kind)
    return norms


def _squared(node: ir.Node | None) -> ir.Value | None:
    """If `node` computes z**2 (Pow(z, 2) or Mul(z, z)), return z without casts."""
    if node is None:
        return None
    if node.op_type == "Pow":
        exponent = _constant_tensor(node.inputs[1]) if node.inputs[1] is not None else None
        if exponent is not None and float(exponent.numpy().reshape(-1)[0]) == 2.0:
            return _strip_casts(node.inputs[0])
    if node.op_type == "Mul" and node.inputs[0] is node.inputs[1]:
        return _strip_casts(node.inputs[0])
    return None


def _is_mean_of(mean: ir.Value | None, x: ir.Value | None) -> bool:
    node = mean.producer() if mean is not None else None
    return node is not None and node.op_type == "ReduceMean" and _strip_casts(node.inputs[0]) is _strip_casts(x)


def _reduces_last_axis(node: ir.Node) -> bool:
    axes = None
    if "axes" in node.attributes:
        axes = list(node.attributes["axes"].value)
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        tensor = _constant_tensor(node.inputs[1])
        if tensor is None:
            return False
        axes = [int(a) for a in tensor.numpy().reshape(-1)]
    if axes is None or len(axes) != 1:
        return False
    rank = node.inputs[0].shape.rank() if node.inputs[0].shape is not None else None
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def _constant_tensor(value: ir.Value):
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].value
    return None


def _strip_casts(value: ir.Value | None) -> ir.Value | None:
    while value is not None and value.producer() is not None and value.producer().op_type in ("Cast", "Identity"):
        value = value.producer().inputs[0]
    return value


class _ConstantTest:
    """value -> True when it is a weight (ops.is_weight), memoized."""

    def __init__(self) -> None:
        self._memo: dict[ir.Value, bool] = {}

    def __call__(self, value: ir.Value | None) -> bool:
        if value is None:
            return False
        if value not in self._memo:
            self._memo[value] = ops.is_weight(value)
        return self._memo[value]


def _sum_terms(value: ir.Value, is_const: _ConstantTest) -> list[ir.Value]:
    """Flatten the stream value `value` as a sum: descend through Adds of two computed operands into operands that only the Add reads; an operand something else
    reads too is a stream value or a branch output. Exporters may let the residual Add read an identity Cast that a normalisation also reads; the stream value
    is then the Cast's input (see _skip's caller)."""
    node = _strip_casts(value).producer()
    if node is None or node.op_type != "Add" or len(node.inputs) != 2 or any(is_const(x) for x in node.inputs):
        return [value]
    terms = []
    for operand in node.inputs:
        inner = _strip_casts(operand).producer()
        if inner is not None and inner.op_type == "Add" and _read_once(operand):
            terms += _sum_terms(operand, is_const)
        else:
            terms.append(operand)
    return terms if len(terms) > 1 else [value]


def _read_once(value: ir.Value) -> bool:
    """True when only one node reads `value`, and only one reads each value it is a Cast / Identity of."""
    while True:
        if len(value.uses()) != 1 or value.is_graph_output():
            return False
        node = value.producer()
        if node is None or node.op_type not in ("Cast", "Identity"):
            return True
        value = node.inputs[0]


def _skip(terms: list[ir.Value], order: dict[ir.Node, int]) -> ir.Value | None:
    """The residual operand of a sum: the one term every other term is computed from (None if none is).
    This is what tells the stream from a branch whose output is normalised (Gemma 2, OLMo 2)."""
    if len(terms) < 2:
        return None
    found = [t for t in terms if all(o is t or _depends(o, _strip_casts(t), order) for o in terms)]
    return found[0] if len(found) == 1 else None


def _depends(value: ir.Value, on: ir.Value, order: dict[ir.Node, int]) -> bool:
    """True when `value` is computed from `on`. Only nodes after `on`'s producer can read it."""
    start = _position(on, order)
    seen: set[ir.Node] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        if v is on:
            return True
        node = v.producer()
        if node is None or node in seen or order[node] <= start:
            continue
        seen.add(node)
        todo.extend(x for x in node.inputs if x is not None)
    return False


def _branch_nodes(output: ir.Value, stream: set[ir.Value]) -> set[ir.Node]:
    """Nodes that compute `output`, not looking past residual-stream values."""
    seen: set[ir.Node] = set()
    todo = [output]
    while todo:
        value = todo.pop()
        node = value.producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(x for x in node.inputs if x is not None and x not in stream)
    return seen


def _branch_kind(output: ir.Value, source: ir.Value, stream: set[ir.Value]) -> str:
    """'attn' if the branch mixes tokens (Softmax or an attention op), 'mlp' if it reads `source` otherwise."""
    nodes = _branch_nodes(output, stream)
    if not any(x is source for n in nodes for x in n.inputs):
        return "unrelated"
    return "attn" if any(n.op_type in ATTENTION_OPS for n in nodes) else "mlp"


def _position(value: ir.Value, order: dict[ir.Node, int]) -> int:
    node = value.producer()
    return -1 if node is None else order[node]


def _op_summary(graph: Iterable[ir.Node], top: int = 6) -> str:
    counts: dict[str, int] = {}
    for node in graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    common = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{n} {op}" for op, n in common) or "none"
