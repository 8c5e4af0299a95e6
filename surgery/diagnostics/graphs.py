"""Read-only diagnostic graphs built from an exported model. None of them is meant for deployment.

- probe: taps every block's resid_pre / attn_out / resid_mid / mlp_out / resid_post and, for each
  sequential block, also evaluates its ln2 + mlp a second time on resid_pre ("twin"), so the
  sequential-to-parallel defect of all layers comes from one forward pass.
- switchboard: one graph whose input `surgery_switches` [kinds, n_layers] turns, per layer and at
  run time, the parallel form, a compensation fix or a branch edit on (> 0.5) or off, choosing
  exactly with Where (a branch edit with an If: switched off, it computes nothing). One session then
  measures every single-layer rewrite, or any set of them.
  With `fit_taps`, it also outputs what the compensation fit needs at every sequential block,
  whatever the switches: attn_out, P = mlp(ln2(resid_pre)), delta = mlp(ln2(resid_mid)) - P and
  resid_post (each block's mlp is evaluated a second time on the input its branch does not read).
- field: one block's mlp(ln2(z)) for any z, for the critical points of the mlp field.
- resumable: each block's nodes in an If, so that a run can start at block `surgery_start` from a resid_pre
  an earlier run of the same inputs output; blocks before it compute nothing. An edit at block l then
  leaves blocks < l to that earlier run.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery import graph
from surgery.blocks import BlockMap, branch_nodes, find_blocks
from surgery.graph import values_by_name
from surgery.passes import projection
from surgery.passes.parallel import redirect
from surgery.passes.common import float_dtype
from surgery.passes.project import edit_nodes, sink_mask

SWITCHES, FIELD_IN, FIELD_OUT = "surgery_switches", "surgery_z", "surgery_field"
START, RESUME = "surgery_start", "surgery_resid_pre"
TENSORS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")


@dataclasses.dataclass(frozen=True)
class Probe:
    """A probe graph and the output names it adds: outputs[layer][tensor] (tensor also `mlp_out_on_pre`)."""

    model: ir.Model
    outputs: tuple[dict[str, str], ...]


def probe(model: ir.Model, tensors=TENSORS, twin: bool = True) -> Probe:
    """Tap the blocks' tensors and, with `twin`, add each sequential block's mlp(ln2(resid_pre))."""
    blocks = find_blocks(model)
    model = model.clone()
    values = values_by_name(model)
    outputs = []
    for block in blocks:
        names = {k: v for k, v in block.tensors().items() if k in tensors}
        if twin and not block.is_parallel:
            mapping = _copy(model.graph, branch_nodes(model, block, "mlp"), {values[block.resid_mid]: values[block.resid_pre]}, f"surgery/twin/blocks.{block.layer}")
            names["mlp_out_on_pre"] = mapping[values[block.mlp_out]].name
        outputs.append(names)
    model.graph.sort()
    tapped = graph.tap(model, [name for names in outputs for name in names.values()])
    return Probe(tapped, tuple(outputs))


FIT_TAPS = ("attn_out", "mlp_x", "delta", "resid_post")  # what a fit graph outputs per sequential block


KEEP_SINK = "keep-sink"  # a kind's third part: tokens at position 0 keep the branch output


def fit_tap(layer: int, what: str) -> str:
    """Output name of a fit tap: `what` is one of FIT_TAPS (mlp_x is P)."""
    return f"surgery/fit/blocks.{layer}/{what}"


def switchboard(
    model: ir.Model, kinds: list[tuple[str, ...]], fixes: dict | None = None, fit_taps: bool = False, lazy: bool = True
) -> ir.Model:
    """A graph with per-layer run-time switches.

    kinds: ("parallel",), ("compensated",), (branch, mode) as in `project`, or (branch, mode, KEEP_SINK)
    as project(..., keep_sink=True). "compensated" on
    gives the block fixes[layer] (a passes.Fix): W_o and W_down switch to the folded weights, as the
    compensate pass writes them (switch "parallel" on too for the compensated parallel block). With
    fit_taps (which needs ("parallel",) in kinds) the fix is instead added after the branch,
    attn_out w_a + mlp_out w_p + b, so the taps read the unfixed attn_out and mlp_out.
    lazy: a branch edit is chosen by an If that computes it only while on; False: by a Where, computed always.
    The numbers are the same, except in float16 on CPU: ONNX Runtime keeps values in float32 between ops
    without float16 kernels but rounds them to float16 where they cross an If's boundary.
    """
    blocks = find_blocks(model)
    model = model.clone()
    g = model.graph
    values = values_by_name(model)
    dtype = float_dtype(model)
    n = len(blocks)
    switches = ir.Value(name=SWITCHES, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([len(kinds), n]))
    g.inputs.append(switches)
    flat = _op(g, "Reshape", [switches, _const(g, "surgery/switchboard/flat_shape", np.array([-1], np.int64))], "surgery/switchboard/flat")
    half = _const(g, "surgery/switchboard/half", np.array(0.5, np.float32))
    feeding: dict[tuple[int, str], ir.Value] = {}  # what each branch's residual add reads now
    sink = None  # position 0's mask, made once when a keep-sink kind asks for it
    for k, kind in enumerate(kinds):
        for block in blocks:
            prefix = f"surgery/switchboard/{'_'.join(kind)}/blocks.{block.layer}"
            index = _const(g, f"{prefix}/index", np.array(k * n + block.layer, np.int64))
            on = _op(g, "Greater", [_op(g, "Gather", [flat, index], f"{prefix}/switch"), half], f"{prefix}/on")
            if kind == ("parallel",):
                if block.is_parallel:
                    continue
                mid, pre = values[block.resid_mid], values[block.resid_pre]
                mlp = branch_nodes(model, block, "mlp")
                if fit_taps:
                    _add_fit_taps(g, block, mlp, values, on, prefix)
                chosen = _op(g, "Where", [on, pre, mid], f"{prefix}/mlp_in")
                redirect(g, mlp, mid, chosen, block.layer, "switchboard")
            elif kind == ("compensated",):
                fix = (fixes or {}).get(block.layer)
                if fix is None or block.is_parallel:
                    continue
                if not fit_taps:  # the folded weights themselves, chosen by the switch: no extra MatMuls
                    _switch_weights(g, block, values, fix, on, prefix)
                    continue
                # Fitting reads the unfixed attn_out and mlp_out, so the fix is added after the branch.
                current = feeding.get((block.layer, "mlp"), values[block.mlp_out])
                fixed = _fixed(g, current, values[block.attn_out], values[block.mlp_out], fix, prefix, dtype)
                chosen = _op(g, "Where", [on, fixed, current], f"{prefix}/chosen")
                for user, i in list(current.uses()):
                    if user.op_type == "Add" and not user.name.startswith(prefix):
                        user.replace_input_with(i, chosen)
                feeding[(block.layer, "mlp")] = chosen
            else:
                branch, mode, *keep = kind
                out = values[block.mlp_out if branch == "mlp" else block.attn_out]
                ref = values[block.mlp_in if branch == "mlp" else block.resid_pre]
                nodes, edited = edit_nodes(out, ref, mode, None, prefix, float_dtype(model, out))
                if keep == [KEEP_SINK]:
                    sink = sink if sink is not None else sink_mask(model, "surgery/switchboard/sink")
                    nodes.append(ir.node("Where", [sink, out, edited], name=f"{prefix}/keep_sink"))
                    edited = nodes[-1].outputs[0]
                    edited.name = f"{prefix}/keep_sink"
                current = feeding.get((block.layer, branch), out)
                chosen = _either(g, on, nodes, edited, current, f"{prefix}/chosen", lazy)
                for user, i in list(current.uses()):
                    if user.op_type == "Add" and user not in nodes:
                        user.replace_input_with(i, chosen)
                feeding[(block.layer, branch)] = chosen
    g.sort()
    return model


def _either(g: ir.Graph, on: ir.Value, nodes: list[ir.Node], edited: ir.Value, current: ir.Value, name: str, lazy: bool) -> ir.Value:
    """`edited` (computed by `nodes`) when `on`, else `current`: an If, so that an edit switched off computes nothing
    (lazy), or a Where of both."""
    if not lazy:
        g.extend(nodes)
        return _op(g, "Where", [on, edited, current], name)
    off = ir.node("Identity", [current], name=f"{name}/off")
    off.outputs[0].name = f"{name}/off"
    branches = {
        "then_branch": ir.Graph([], [edited], nodes=nodes, name=f"{name}/on"),
        "else_branch": ir.Graph([], off.outputs, nodes=[off], name=f"{name}/off"),
    }
    node = ir.node("If", [on], attributes=branches, name=name)
    node.outputs[0].name = name
    g.append(node)
    return node.outputs[0]


def _add_fit_taps(g: ir.Graph, block: BlockMap, mlp: set[ir.Node], values, on: ir.Value, prefix: str) -> None:
    """Outputs attn_out, mlp_x, delta, resid_post of a sequential block, with its parallel switch `on` or off."""
    mid, pre = values[block.resid_mid], values[block.resid_pre]
    other = _op(g, "Where", [on, mid, pre], f"{prefix}/twin_in")  # the input the mlp branch does not read
    twin = _copy(g, mlp, {mid: other}, f"{prefix}/twin")[values[block.mlp_out]]
    own = values[block.mlp_out]
    on_mid = _op(g, "Where", [on, twin, own], f"{prefix}/mlp_h")
    on_pre = _op(g, "Where", [on, own, twin], fit_tap(block.layer, "mlp_x"))
    delta = _op(g, "Sub", [on_mid, on_pre], fit_tap(block.layer, "delta"))
    stream_type = values[block.resid_pre].type
    for what, value in (("attn_out", values[block.attn_out]), ("resid_post", values[block.resid_post])):
        value = _op(g, "Identity", [value], fit_tap(block.layer, what))
        value.type = stream_type
        g.outputs.append(value)
    for value in (on_pre, delta):
        value.type = stream_type
        g.outputs.append(value)


def _switch_weights(g: ir.Graph, block: BlockMap, values, fix, on: ir.Value, prefix: str) -> None:
    """W_o, W_down and their biases become Where(on, folded, original), as `compensate` folds them."""
    attn = projection.producing(values[block.attn_out], block.layer, "attn_out", why="compensate")
    mlp = projection.producing(values[block.mlp_out], block.layer, "mlp_out", why="compensate")
    for p, (w, b), what in zip((attn, mlp), fix.fold(attn, mlp), ("o_proj", "down_proj")):
        w, b = projection.rounded(p, w, b)  # as `compensate` writes them
        stored = _const(g, f"{prefix}/{what}/weight", np.ascontiguousarray(w.T if p.transposed else w))
        p.node.replace_input_with(1, _op(g, "Where", [on, stored, p.node.inputs[1]], f"{prefix}/{what}/weight_on"))
        if b is None:
            continue
        bias = _const(g, f"{prefix}/{what}/bias", b)
        if p.bias_site is not None:
            node, i = p.bias_site
            node.replace_input_with(i, _op(g, "Where", [on, bias, node.inputs[i]], f"{prefix}/{what}/bias_on"))
            continue
        zeros = _const(g, f"{prefix}/{what}/no_bias", np.zeros(len(b), b.dtype))
        uses = list(p.output.uses())
        added = _op(g, "Add", [p.output, _op(g, "Where", [on, bias, zeros], f"{prefix}/{what}/bias_on")], f"{prefix}/{what}/out")
        for user, i in uses:
            user.replace_input_with(i, added)


def _fixed(g: ir.Graph, current: ir.Value, attn_out: ir.Value, mlp_out: ir.Value, fix, prefix: str, dtype) -> ir.Value:
    """current + attn_out w_a + mlp_out w_p + b (terms that are None left out)."""
    total = current
    if fix.w_a is not None:
        w = _const(g, f"{prefix}/w_a", np.asarray(fix.w_a, dtype))
        total = _op(g, "Add", [total, _op(g, "MatMul", [attn_out, w], f"{prefix}/attn_fix")], f"{prefix}/plus_attn_fix")
    if fix.w_p is not None:
        w = _const(g, f"{prefix}/w_p", np.asarray(fix.w_p, dtype))
        term = _op(g, "Mul" if np.ndim(fix.w_p) == 0 else "MatMul", [mlp_out, w], f"{prefix}/mlp_fix")
        total = _op(g, "Add", [total, term], f"{prefix}/plus_mlp_fix")
    if fix.b is not None:
        total = _op(g, "Add", [total, _const(g, f"{prefix}/b", np.asarray(fix.b, dtype))], f"{prefix}/plus_b")
    return total


def switches(kinds: list[tuple[str, ...]], n_layers: int, on: dict[tuple[str, ...], set[int]] | None = None) -> np.ndarray:
    """The switchboard input with kind k on at the layers in on[kind]."""
    array = np.zeros((len(kinds), n_layers), np.float32)
    for kind, layers in (on or {}).items():
        array[kinds.index(kind), sorted(layers)] = 1.0
    return array


@dataclasses.dataclass(frozen=True)
class Resumable:
    """A resumable graph; resid_post[l] names its output with block l's resid_post, for every block but the last.
    `inputs` does not read `model` (None where the graph travels separately)."""

    model: ir.Model | None
    resid_post: tuple[str, ...]
    dtype: np.dtype  # of the residual stream

    def inputs(self, start: int, kept: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs that run blocks start.. from kept[resid_post[start - 1]], an earlier run's output
        (start 0 reads no stream: its [1, 0, 0] stand-in is never read)."""
        resid_pre = kept[self.resid_post[start - 1]] if start else np.zeros((1, 0, 0), self.dtype)
        return {START: np.array(start, np.int64), RESUME: resid_pre}


def resumable(model: ir.Model, blocks: list[BlockMap]) -> Resumable | None:
    """Put each block but the last in an If that runs it only when its layer >= `surgery_start` (int64 scalar).

    Block `surgery_start` then reads `surgery_resid_pre` [batch, pos, d_model] as its resid_pre (block start - 1's
    resid_post, as an earlier run of the same inputs output it); the blocks before it compute nothing. What blocks
    read besides the stream (masks, rotary tables, positions, switches) is still computed from the graph inputs.
    Of the model's outputs `logits` stays (the KV cache outputs would need every block); each wrapped block's
    resid_post is added.

    Args:
        model: a decoder, or a switchboard of one.
        blocks: find_blocks of the decoder (a switchboard's Ifs hide the blocks from find_blocks).

    Returns None when a block computes a value that something outside it reads: it cannot be skipped.
    """
    model = model.clone()
    g = model.graph
    logits = [v for v in g.outputs if v.name == "logits"]
    g.outputs.clear()
    g.outputs.extend(logits)
    RemoveUnusedNodesPass()(model)
    values = values_by_name(model)
    dtype = graph.stream_dtype(model)
    start = ir.Value(name=START, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    resume = ir.Value(name=RESUME, type=ir.TensorType(dtype), shape=ir.Shape(["batch", "pos", "d_model"]))
    g.inputs.extend([start, resume])
    holder = {inner: node for node in g for inner in _inner_nodes(node)}  # a node in a subgraph -> the node of g holding it
    wrapped: dict[ir.Value, ir.Value] = {}  # a block's resid_post -> the If output that replaces it
    for block in blocks[:-1]:
        pre, post = values[block.resid_pre], values[block.resid_post]
        nodes = _block_nodes(wrapped.get(pre, pre), post, holder)
        if post.producer() not in nodes or _leaks(nodes, post, holder):
            return None
        wrapped[post] = _skippable(g, nodes, post, start, resume, block.layer)
    g.sort()
    g.outputs.extend(wrapped.values())
    return Resumable(model, tuple(v.name for v in wrapped.values()), dtype.numpy())


def _block_nodes(pre: ir.Value, post: ir.Value, holder: dict[ir.Node, ir.Node]) -> set[ir.Node]:
    """The nodes computing `post` from `pre`: on a path from pre to post, a node with subgraphs (a switch) reading
    what they read. A Shape (or Size) of pre itself is left out: what it computes (masks, positions) does not change
    when pre does, and other blocks read it."""
    down, todo = set(), [pre]
    while todo:
        value = todo.pop()
        for user, _ in value.uses():
            user = holder.get(user, user)
            if user not in down and not (value is pre and user.op_type in ("Shape", "Size")):
                down.add(user)
                todo.extend(user.outputs)
    up, todo = set(), [post]
    while todo:
        node = todo.pop().producer()
        if node in down and node not in up:
            up.add(node)
            todo.extend(x for n in (node, *_inner_nodes(node)) for x in n.inputs if x is not None)
    return up


def _leaks(nodes: set[ir.Node], post: ir.Value, holder: dict[ir.Node, ir.Node]) -> bool:
    """True when a value that `nodes` compute, other than `post`, is a graph output or read by a node outside them."""
    inside = [v for node in nodes for v in node.outputs if v is not post]
    return any(v.is_graph_output() or any(holder.get(u, u) not in nodes for u, _ in v.uses()) for v in inside)


def _inner_nodes(node: ir.Node) -> list[ir.Node]:
    """The nodes of the node's subgraphs (an If's branches), at any depth."""
    return [inner for attr in node.attributes.values() if attr.type == ir.AttributeType.GRAPH for inner in attr.value.all_nodes()]


def _skippable(g: ir.Graph, nodes: set[ir.Node], post: ir.Value, start: ir.Value, resume: ir.Value, layer: int) -> ir.Value:
    """Move block `layer`'s `nodes` into an If that runs them when start <= layer and else hands on `resume`;
    the If's output replaces `post` outside the block."""
    prefix = f"surgery/resume/blocks.{layer}"
    uses = [(user, i) for user, i in post.uses() if user not in nodes]
    moved = [node for node in g if node in nodes]  # in graph order
    g.remove(moved)
    skip = ir.node("Identity", [resume], name=f"{prefix}/skipped")
    skip.outputs[0].name = f"{prefix}/skipped"
    runs = _op(g, "LessOrEqual", [start, _const(g, f"{prefix}/layer", np.array(layer, np.int64))], f"{prefix}/runs")
    branches = {
        "then_branch": ir.Graph([], [post], nodes=moved, name=f"{prefix}/run"),
        "else_branch": ir.Graph([], skip.outputs, nodes=[skip], name=f"{prefix}/skip"),
    }
    node = ir.node("If", [runs], attributes=branches, name=prefix)
    out = node.outputs[0]
    out.name, out.type, out.shape = f"{prefix}/resid_post", post.type, post.shape
    g.append(node)
    for user, i in uses:
        user.replace_input_with(i, out)
    return out


def field(model: ir.Model, block: BlockMap) -> ir.Model:
    """A graph from `surgery_z` [batch, pos, d_model] to `surgery_field` = mlp(ln2(z)) of one block.

    Only the block's ln2 and mlp nodes are copied, into a new graph sharing their weights: cloning the whole
    model first took 0.6 s per SmolLM2 layer (the session itself 0.1 s)."""
    nodes = branch_nodes(model, block, "mlp")
    values = {v.name: v for node in nodes for v in (*node.inputs, *node.outputs) if v is not None}
    prefix = f"surgery/field/blocks.{block.layer}"
    z = ir.Value(name=FIELD_IN, type=ir.TensorType(graph.stream_dtype(model)), shape=ir.Shape(["batch", "pos", "d_model"]))
    mapping = {values[block.mlp_in]: z}
    inputs, initializers, copies = [z], [], []
    for node in model.graph:  # graph order is topological: every producer is copied before its users
        if node not in nodes:
            continue
        for x in node.inputs:
            if x is not None and x not in mapping:  # a weight or a graph input: the branch reads no other node
                mapping[x] = ir.Value(name=x.name, type=x.type, shape=x.shape, const_value=x.const_value)
                (initializers if x.is_initializer() else inputs).append(mapping[x])
        copy = ir.Node(
            node.domain, node.op_type, [None if x is None else mapping[x] for x in node.inputs], attributes=list(node.attributes.values()),
            num_outputs=len(node.outputs), name=f"{prefix}/{node.name}", overload=node.overload, version=node.version,
        )
        for original, new in zip(node.outputs, copy.outputs):
            new.name = f"{prefix}/{original.name}"
            if original.type is not None:
                new.type, new.shape = original.type, original.shape
            mapping[original] = new
        copies.append(copy)
    out = mapping[values[block.mlp_out]]
    out.name = FIELD_OUT
    if out.dtype is None:
        out.dtype = z.dtype
    g = ir.Graph(inputs, [out], nodes=copies, initializers=initializers, opset_imports=dict(model.opset_imports), name="surgery_field")
    return ir.Model(g, ir_version=model.ir_version, functions=list(model.functions.values()))


def _copy(g: ir.Graph, nodes: set[ir.Node], mapping: dict[ir.Value, ir.Value], prefix: str) -> dict[ir.Value, ir.Value]:
    """Append copies of `nodes` (kept in graph order) reading mapping[v] wherever an original read v."""
    mapping = dict(mapping)
    copies = []
    for node in g:
        if node not in nodes:
            continue
        inputs = [None if x is None else mapping.get(x, x) for x in node.inputs]
        copy = ir.Node(
            node.domain, node.op_type, inputs, attributes=list(node.attributes.values()),
            num_outputs=len(node.outputs), name=f"{prefix}/{node.name}", overload=node.overload, version=node.version,
        )
        for original, new in zip(node.outputs, copy.outputs):
            new.name = f"{prefix}/{original.name}"
            if original.type is not None:
                new.type, new.shape = original.type, original.shape
            mapping[original] = new
        copies.append(copy)
    g.extend(copies)
    return mapping


def _const(g: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    g.register_initializer(value)
    return value


def _op(g: ir.Graph, op_type: str, inputs: list[ir.Value], name: str) -> ir.Value:
    node = ir.node(op_type, inputs, name=name)
    node.outputs[0].name = name
    g.append(node)
    return node.outputs[0]
