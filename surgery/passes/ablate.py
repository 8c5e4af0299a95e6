"""ablate: the residual add receives a part of a branch's output instead of all of it.

For the mlp, relative to v = resid_mid / |resid_mid| (resid_pre in a parallel block); for attention,
relative to u = resid_pre / |resid_pre|, per token:

    tangential  B - <d,B> d        radial  <d,B> d        remove  0 * B        scale  a * B
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Literal, get_args

import numpy as np
import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.files import metadata
from surgery.model.blocks import BlockMap, Branch
from surgery.model.nodes import Emitter
from surgery.passes.common import Board, Change, Pass, SurgeryResult, float_dtype, narrower_than_float32, node_name, register
from surgery.passes.driver import apply_pass

NAME = "ablate"
Mode = Literal["tangential", "radial", "remove", "scale"]
BRANCHES: tuple[Branch, ...] = get_args(Branch)
MODES: tuple[Mode, ...] = get_args(Mode)


@dataclasses.dataclass(frozen=True)
class Ablation:
    """What the residual add of `branch` receives: its `mode` part (scale: `scale` times it); keep_sink: tokens at
    position 0 (the attention sink) keep the whole branch output."""

    branch: Branch
    mode: Mode
    scale: float | None = None
    keep_sink: bool = False

    def __post_init__(self):
        _check(self.branch, self.mode, self.scale)

    @property
    def label(self) -> str:
        """What the edit computes, as the graph records it: `mlp tangential`, `attn scale=0.5`."""
        return f"{self.branch} {self.mode}" + (f"={self.scale:g}" if self.mode == "scale" else "") + (" keep-sink" if self.keep_sink else "")


class Ablate(Pass):
    """Replace the selected blocks' branch output in the residual add by a part of it (module docstring).
    Idempotent: a block whose branch already went through the same edit is left alone."""

    name = NAME
    Args = Ablation

    def refusal(self, subject, block: BlockMap, args: Ablation) -> str | None:
        if block.fused:
            return f"block {block.layer} is fused: attn_out and mlp_out come from one MatMul; ablate before `--fuse`"
        return None

    def done(self, subject, block: BlockMap, args: Ablation) -> str | None:
        producer = subject.values[block.output(args.branch)].producer()
        return f"already {args.label}" if producer is not None and producer.metadata_props.get(metadata.EDIT) == args.label else None

    def apply(self, subject, block: BlockMap, args: Ablation) -> Change:
        values, taken = subject.values, set(subject.values)
        out = values[block.output(args.branch)]
        ref = values[block.mlp_in if args.branch == "mlp" else block.resid_pre]
        prefix = unique_name(node_name(NAME, block.layer, f"{args.branch}_out_{args.mode}"), taken)
        sink = subject.shared("sink", lambda: sink_mask(subject.model, unique_name(f"surgery/{NAME}/sink", taken))) if args.keep_sink else None
        nodes, new_out = edit_nodes(out, ref, args.mode, args.scale, prefix, float_dtype(subject.model, out, subject.stream), sink)
        nodes[-1].metadata_props[metadata.EDIT] = args.label
        subject.graph.insert_after(out.producer(), nodes)
        for user, index in list(out.uses()):
            if user.op_type == "Add" and user not in nodes:  # the residual add, not our own nodes
                user.replace_input_with(index, new_out)
        return Change(block.layer, args.label)

    def switch(self, board: Board, block: BlockMap, on: ir.Value, args: Ablation) -> None:
        """The residual add receives the edited branch output while `on` (board.choose: computed only while on, where the
        switchboard is lazy)."""
        out, ref = board.values[block.output(args.branch)], board.values[block.mlp_in if args.branch == "mlp" else block.resid_pre]
        sink = board.shared("sink", lambda: sink_mask(board.model, "surgery/switchboard/sink")) if args.keep_sink else None
        built, edited = edit_nodes(out, ref, args.mode, args.scale, board.prefix, float_dtype(board.model, out, board.dtype), sink)
        board.choose(block, args.branch, on, built, edited, f"{board.prefix}/chosen")

    def options(self, args: Ablation, layers) -> dict:
        return {"branch": args.branch, "mode": args.mode, "scale": args.scale, "keep_sink": args.keep_sink or None}

    def example(self, subject, layers) -> Ablation:
        return Ablation("mlp", "tangential")


ABLATE = register(Ablate())


def ablate(model, branch: Branch, mode: Mode, layers: Collection[int], scale: float | None = None, keep_sink: bool = False) -> SurgeryResult:
    """Replace the selected blocks' `branch` output in the residual add by its `mode` part (Ablate).

    The part is taken per token, relative to the direction of the stream the branch reads: v = resid_mid / |resid_mid|
    for the mlp (resid_pre in a parallel block), u = resid_pre / |resid_pre| for attention (module docstring). Only the
    residual add reads the edited output; a block whose branch went through the same edit already is left alone.

    Args:
        model (ir.Model | Subject): an `onnx_ir.Model`, or a Subject (from `load`, or a result's `.subject`); it is not modified.
        branch: `attn` (attn_out) or `mlp` (mlp_out).
        mode: what the residual add receives of the branch output B, with d the direction above: `tangential`
            (B - <d,B> d), `radial` (<d,B> d), `remove` (nothing) or `scale` (scale * B).
        layers: the blocks to edit, by index from 0; negative ones count from the end.
        scale: the factor of mode `scale` (finite; required there, and only there).
        keep_sink: tokens at position 0 (the attention sink) keep the whole branch output.

    Returns:
        A SurgeryResult: the new model, one Change per selected block in order (the edit, e.g. `mlp tangential`, or
        why it was left alone), and the rewritten subject.

    Raises:
        SurgeryError: an unknown branch or mode, a missing, non-finite or misplaced `scale`, a layer out of range or a
            fused block (before any work), or `keep_sink` on a graph with neither a position_ids nor an input_ids input.
    """
    return apply_pass(model, ABLATE, layers, Ablation(branch, mode, scale, keep_sink))


def _check(branch: str, mode: str, scale: float | None) -> None:
    if branch not in BRANCHES:
        raise SurgeryError(f"unknown branch {branch!r}; use one of {', '.join(BRANCHES)}")
    if mode not in MODES:
        raise SurgeryError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "scale" and scale is None:
        raise SurgeryError("mode scale needs a factor; add --scale A")
    if mode == "scale" and not math.isfinite(scale):
        raise SurgeryError(f"--scale {scale}: give a finite factor")
    if mode != "scale" and scale is not None:
        raise SurgeryError(f"--scale only goes with mode scale, not {mode}")


def edit_nodes(out: ir.Value, ref: ir.Value, mode: str, scale, prefix: str, dtype, sink: ir.Value | None = None) -> tuple[list[ir.Node], ir.Value]:
    """Nodes computing the edited branch output from `out` [batch, pos, d_model] and direction source `ref`;
    with `sink` (sink_mask's value), the tokens at position 0 keep `out` whole.

    dtype: the branch output's float type; constants take it. In fp16 / bf16 the tangential and
    radial parts are computed in float32 between Casts: |ref|^2 over d_model overflows float16
    (SmolLM2's resid_mid reaches coordinates of 2.5e4 and |x|^2 of 6e8; float16 ends at 65504).
    """
    nodes: list[ir.Node] = []
    e = Emitter(prefix, nodes=nodes)
    op, const = e.op, e.const
    whole = out

    if mode in ("remove", "scale"):
        factor = const("factor", np.array(0.0 if mode == "remove" else scale, dtype=dtype))
        result = op("Mul", [out, factor], "scaled")
    else:
        narrow = narrower_than_float32(dtype)
        if narrow:
            out = op("Cast", [out], "out_float", to=ir.DataType.FLOAT)
            ref = op("Cast", [ref], "ref_float", to=ir.DataType.FLOAT)
        work = np.float32 if narrow else dtype
        axes = const("axes", np.array([-1], dtype=np.int64))
        dot = op("ReduceSum", [op("Mul", [ref, out], "ref_times_out"), axes], "dot", keepdims=1)  # [batch, pos, 1]
        norm2 = op("ReduceSum", [op("Mul", [ref, ref], "ref_squared"), axes], "ref_norm2", keepdims=1)
        tiny = const("tiny", np.array(np.finfo(work).tiny, dtype=work))
        coef = op("Div", [dot, op("Max", [norm2, tiny], "ref_norm2_safe")], "coef")  # <d, B> / |ref| along d
        radial = op("Mul", [coef, ref], "radial")
        result = radial if mode == "radial" else op("Sub", [out, radial], "tangential")
        if narrow:  # rounded once, back to the branch output's type
            result = op("Cast", [result], "to_" + np.dtype(dtype).name, to=ir.DataType.from_numpy(np.dtype(dtype)))
    result.name = prefix
    if sink is not None:
        result = op("Where", [sink, whole, result], "keep_sink")
    return nodes, result


def sink_mask(model: ir.Model, prefix: str) -> ir.Value:
    """A boolean [batch | 1, seq, 1] value, true at the tokens whose position is 0, from the graph inputs:
    position_ids when the graph has them, else the token index after the KV cache's length (0 without one).
    Its nodes go first in the graph, so every block can read it."""
    inputs = {v.name: v for v in model.graph.inputs}
    nodes: list[ir.Node] = []
    e = Emitter(prefix, nodes=nodes)
    op = e.op
    const = lambda what, value: e.const(what, np.array(value, np.int64))  # noqa: E731

    if "position_ids" in inputs:
        positions = inputs["position_ids"]  # [batch, seq]
    elif "input_ids" in inputs:
        seq = op("Shape", [inputs["input_ids"]], "seq", start=1, end=2)
        past = next((v for n, v in inputs.items() if n.startswith("past_key_values")), None)
        start = op("Shape", [past], "past", start=2, end=3) if past is not None else const("zero", [0])
        squeeze = const("axis0", [0])
        first, count = op("Squeeze", [start, squeeze], "first"), op("Squeeze", [seq, squeeze], "count")
        positions = op("Range", [first, op("Add", [first, count], "end"), const("one", 1)], "positions")  # [seq]
    else:
        raise SurgeryError("--keep-sink needs the graph's position_ids or input_ids input to find position 0")
    is_first = op("Equal", [positions, const("zero_position", 0)], "is_position_0")
    mask = op("Unsqueeze", [is_first, const("last", [-1])], "mask")
    model.graph.insert_before(next(iter(model.graph)), nodes)
    return mask


def unique_name(name: str, taken: set[str]) -> str:
    candidate, i = name, 2
    while any(t == candidate or t.startswith(candidate + "/") for t in taken):
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate
