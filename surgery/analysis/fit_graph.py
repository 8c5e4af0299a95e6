"""The fit graph: the switchboard of the two forms (`kinds`: parallel, compensated) reduced to the taps the compensation fit sums, per sequential block.

attn_out, P = mlp(ln2(resid_pre)), delta = mlp(ln2(resid_mid)) - P and resid_post (FIT_TAPS), whatever the switches:
each block's mlp is evaluated a second time, on the input its branch does not read. Where W_o and W_down are
MatMulNBits, also their inputs (INPUT_TAPS); in the input side's stage, ln2(resid_pre) and ln2(resid_mid) as the
mlp reads them instead (MLP_IN_TAPS). A graph can resume from an earlier pass's stream (RESUME) and hand its own on
(STREAM), so each pass of surgery.compensation.fitting.fit runs only its own blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import Literal, get_args

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery.analysis import switchboard as board_graph
from surgery.analysis.probe import twin_branch
from surgery.analysis.switchboard import Switch
from surgery.files import metadata
from surgery.model.blocks import BlockMap, branch_nodes
from surgery.model.nodes import Emitter, values_by_name
from surgery.model.subject import Subject
from surgery.passes import COMPENSATE, Compensation, Fix, fold, projection

Form = Literal["compensated", "plain"]  # a parallel block with its fix folded in, or without
PARALLEL = Switch(metadata.PARALLELIZE)
FIT_TAPS = ("attn_out", "mlp_x", "delta", "resid_post")  # what the fit graph outputs per sequential block
INPUT_TAPS = ("o_in", "down_in")  # ... and, where W_o and W_down are MatMulNBits, their inputs (the parallel block's)
MLP_IN_TAPS = ("mlp_u", "mlp_v")  # ... and in the input side's pass: ln2(resid_pre) and ln2(resid_mid) as the mlp reads them
Stage = Literal["inputs", "outputs"]  # a fit graph's taps: the input side's (MLP_IN_TAPS) or the output side's (the rest)
STAGES: tuple[Stage, ...] = get_args(Stage)
RESUME, STREAM = "surgery/fit/resid_pre", "surgery/fit/stream"  # a pass's stream into its first block, from the pass before


def kinds(fixes: Mapping[int, Fix] | None = None, after_branch: bool = False) -> list[Switch]:
    """The switchboard kinds every fit and trial uses: parallel, and compensated with `fixes` (a compensated block has
    both on). after_branch: the fixes are added after the branches (what the fit's taps need)."""
    return [PARALLEL, Switch(COMPENSATE.name, Compensation(dict(fixes or {}), after_branch))]


def switched(n_layers: int, forms: Mapping[int, Form] | None = None) -> np.ndarray:
    """The input of a switchboard of `kinds` with each block of `forms` in its form (the rest as they are)."""
    array = np.zeros((2, n_layers), np.float32)
    for layer, form in (forms or {}).items():
        array[0, layer] = 1.0
        array[1, layer] = float(form == "compensated")
    return array


def fit_tap(layer: int, what: str) -> str:
    """Output name of a fit tap: `what` is one of FIT_TAPS (mlp_x is P)."""
    return f"surgery/fit/blocks.{layer}/{what}"


def fit_graph(model: "ir.Model | Subject", fixes: dict[int, Fix] | None = None, layers: Collection[int] | None = None,
              resume: int | None = None, hand_on: int | None = None, inputs: bool = True, stage: Stage = "outputs",
              input_sides: dict[int, Fix] | None = None) -> ir.Model:
    """The switchboard of `kinds` reduced to the fit taps of the sequential blocks in `layers` (all when None; no logits,
    no KV cache): attn_out, P = mlp(ln2(resid_pre)), delta = mlp(ln2(resid_mid)) - P and resid_post, whatever the
    switches (each block's mlp is evaluated a second time, on the input its branch does not read).

    resume: block `resume` reads its resid_pre from the input RESUME (as an earlier pass handed it on), so the blocks
    before it compute nothing; hand_on: output block `hand_on`'s resid_pre as STREAM. Nothing after the last block
    whose taps or stream are asked for is computed: ORT runs a whole graph whatever outputs a run asks for.
    inputs: also the inputs of W_o and W_down where both are MatMulNBits (INPUT_TAPS), for the error-aware requantization.
    stage: `outputs`, the taps above; `inputs`, the input side's MLP_IN_TAPS instead (ln2(resid_pre) and ln2(resid_mid)
    as the mlp's input projections read them, where they are plain projections), and none of the twin mlp is computed.
    input_sides: per layer, the input side (Fix.w_in, b_in) the parallel block's mlp reads through while the layer's
    parallelize switch is off, so mlp_x and delta are those of the input-fixed parallel block."""
    if stage not in STAGES:
        raise ValueError(f"unknown fit stage {stage!r}")
    subject = Subject.of(model)
    board = board_graph.switchboard(subject, kinds(fixes, after_branch=True), taps=functools.partial(_fit_taps, input_sides=input_sides or {}))
    g = board.graph
    names = MLP_IN_TAPS if stage == "inputs" else FIT_TAPS + (INPUT_TAPS if inputs else ())
    taps = [v for v in g.outputs if v.name.startswith("surgery/fit/") and v.name.endswith(names)
            and (layers is None or v.name.split("/")[2] in {f"blocks.{l}" for l in layers})]
    g.outputs.clear()
    g.outputs.extend(taps)
    blocks = subject.blocks
    values, stream_type = values_by_name(board), ir.TensorType(ir.DataType.from_numpy(subject.stream))
    if hand_on is not None:
        out = Emitter("", graph=g).op("Identity", [values[blocks[hand_on].resid_pre]], STREAM)
        out.type, out.shape = stream_type, ir.Shape(["batch", "pos", "d_model"])
        g.outputs.append(out)
    if resume is not None:
        stream = values[blocks[resume].resid_pre]
        cut = ir.Value(name=RESUME, type=stream_type, shape=ir.Shape(["batch", "pos", "d_model"]))
        for user, i in list(stream.uses()):
            user.replace_input_with(i, cut)
        g.inputs.append(cut)
    RemoveUnusedNodesPass()(board)
    used = [v for v in g.inputs if v.uses()]
    g.inputs.clear()
    g.inputs.extend(used)
    return board


def _fit_taps(board: board_graph.Switchboard, block: BlockMap, ons: dict[Switch, ir.Value], input_sides: dict[int, Fix]) -> None:
    """Output attn_out, mlp_x, delta, resid_post of a sequential block, with its parallelize switch `on` or off, and
    the mlp's input read from resid_pre and from resid_mid (where its input projections are found); with an input
    side in `input_sides`, the twin mlp, while it reads resid_pre, reads it through that side: as float ops, or, for
    MatMulNBits input projections, through the requantized codes compensate writes."""
    if block.is_parallel:
        return
    on, prefix = ons[PARALLEL], f"surgery/fit_taps/blocks.{block.layer}"  # the block's parallelize switch
    g, values, e = board.graph, board.values, board.emitter(prefix)
    mid, pre = values[block.resid_mid], values[block.resid_pre]
    other = e.op("Where", [on, mid, pre], "twin_in")  # the input the mlp branch does not read
    mlp_in = board.mlp_inputs(block)  # before the twin and the taps read ln2's output
    branch = branch_nodes(board.model, block, "mlp", values)
    copies = twin_branch(g, branch, {mid: other}, f"{prefix}/twin")
    top = board.emitter("")
    if not isinstance(mlp_in, str):
        u, twin_u = mlp_in[0], copies[mlp_in[0]]
        readers = {user for user, _ in twin_u.uses()}
        fix = input_sides.get(block.layer)
        twins = projection.reading(twin_u, block.layer) if fix is not None else []
        if any(p.quant is not None for p in twins):  # MatMulNBits: their requantized codes, as compensate writes them
            board.switch_weights(fold.folded(fix, inputs=twins), e.op("Not", [on], "twin_parallel"), f"{prefix}/twin")
        elif fix is not None:
            side = board.emitter(f"{prefix}/twin/mlp_in")
            fixed = board.input_fixed(side, twin_u, fix)
            board.redirect(twin_u, side.op("Where", [on, twin_u, fixed], "chosen"), readers)
        # ln2 of resid_pre and of resid_mid, each from a copy of ln2's nodes: whatever the switches, and without
        # reading ln2's own output, which the parallelize switch requires the branch alone to read
        norm = _producers(u, branch)
        for what, source in (("mlp_u", pre), ("mlp_v", mid)):
            value = top.op("Identity", [twin_branch(g, norm, {mid: source}, f"{prefix}/{what}")[u]], fit_tap(block.layer, what))
            value.type = u.type or values[block.resid_pre].type
            g.outputs.append(value)
    own = values[block.mlp_out]
    twin = copies[own]
    on_mid = e.op("Where", [on, twin, own], "mlp_h")
    on_pre = top.op("Where", [on, own, twin], fit_tap(block.layer, "mlp_x"))
    delta = top.op("Sub", [on_mid, on_pre], fit_tap(block.layer, "delta"))
    stream_type = values[block.resid_pre].type
    for what, value in (("attn_out", values[block.attn_out]), ("resid_post", values[block.resid_post])):
        value = top.op("Identity", [value], fit_tap(block.layer, what))
        value.type = stream_type
        g.outputs.append(value)
    for value in (on_pre, delta):
        value.type = stream_type
        g.outputs.append(value)
    o_proj, down_proj = (projection.quantized_node(values[v]) for v in (block.attn_out, block.mlp_out))
    if o_proj is not None and down_proj is not None:  # the inputs of W_o and of the parallel block's W_down
        h = down_proj.inputs[0]
        for what, value in (("o_in", o_proj.inputs[0]), ("down_in", e.op("Where", [on, h, copies[h]], "down_in_x"))):
            value = top.op("Identity", [value], fit_tap(block.layer, what))
            value.type = stream_type
            g.outputs.append(value)


def _producers(value: ir.Value, within: set[ir.Node]) -> set[ir.Node]:
    """The nodes of `within` that `value` is computed by (it and its ancestors there)."""
    found: set[ir.Node] = set()
    todo = [value.producer()]
    while todo:
        node = todo.pop()
        if node is not None and node in within and node not in found:
            found.add(node)
            todo.extend(x.producer() for x in node.inputs if x is not None)
    return found
