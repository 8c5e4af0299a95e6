"""The resumable graph: each block's nodes in an If, so that a run can start at block `surgery_start` from a
resid_pre an earlier run of the same inputs output; blocks before it compute nothing. An edit at block l then
leaves blocks < l to that earlier run."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery.model.blocks import BlockMap
from surgery.model.embedding import stream_dtype
from surgery.model.nodes import Emitter, if_else, values_by_name

START, RESUME = "surgery_start", "surgery_resid_pre"


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
    dtype = stream_dtype(model)
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
    emit = Emitter(prefix, graph=g)
    runs = emit.op("LessOrEqual", [start, emit.const("layer", np.array(layer, np.int64))], "runs")
    node = if_else(runs, (moved, post), resume, prefix)  # else: the earlier run's stream handed on
    out = node.outputs[0]
    out.name, out.type, out.shape = f"{prefix}/resid_post", post.type, post.shape
    g.append(node)
    for user, i in uses:
        user.replace_input_with(i, out)
    return out
