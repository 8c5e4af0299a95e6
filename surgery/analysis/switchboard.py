"""The switchboard: one graph whose input `surgery_switches` [kinds, n_layers] turns, per layer and at run
time, a pass on (> 0.5) or off, so that one session measures every single-layer rewrite, or any set of them.

A kind is (pass name, *arguments): ("parallelize",), ("compensate",), ("ablate", "mlp", "tangential"),
("ablate", "attn", "remove", "keep-sink"). The switchboard builds nothing itself: each kind's pass builds its
own switch (Pass.switch) with the Board, so the rewrite a session measures is the one the pass writes. A
switch chooses exactly, with a Where, or with an If that computes a branch edit only while it is on (lazy).

`taps` (compensation's fit) adds outputs at every sequential block before its switches are built; with taps,
a compensation fix is added after the branch instead of folded into the weights, so the taps read the
unfixed attn_out and mlp_out.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from surgery import nodes
from surgery.blocks import BlockMap, find_blocks
from surgery.errors import SurgeryError
from surgery.nodes import Emitter, values_by_name
from surgery.passes import PASSES, projection
from surgery.passes.common import Fix, float_dtype

SWITCHES = "surgery_switches"
Kind = tuple[str, ...]
Taps = Callable[["Board", BlockMap, ir.Value, str], None]  # (board, sequential block, its parallelize switch, prefix)


class Board:
    """The switchboard graph while it is built: what a pass's switch builds with."""

    def __init__(self, model: ir.Model, fixes: dict[int, Fix] | None, taps: bool, lazy: bool, before: ir.Model | None = None):
        self.model, self.graph = model, model.graph
        self.before = before if before is not None else model  # the model as given, before any switch or tap
        self.values = values_by_name(model)
        self.fixes = dict(fixes or {})
        self.fix_after_branch = taps  # a fix is added after the branch (the taps read the unfixed outputs)
        self.lazy = lazy
        self.dtype = float_dtype(model)
        self._feeding: dict[tuple[int, str], ir.Value] = {}  # what each branch's residual add reads now
        self._shared: dict[str, ir.Value] = {}
        self._mlp_inputs: dict[int, tuple[ir.Value, list] | str] = {}
        self._before_values: dict[str, ir.Value] | None = None

    def emitter(self, prefix: str) -> Emitter:
        return Emitter(prefix, graph=self.graph)

    def weight(self, name: str, array: np.ndarray) -> ir.Value:
        return nodes.initializer(self.graph, name, array)

    def shared(self, key: str, make: Callable[[], ir.Value]) -> ir.Value:
        """A value every switch may read (a mask), made once."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def mlp_inputs(self, block: BlockMap) -> tuple[ir.Value, list, set[ir.Node]] | str:
        """projection.mlp_inputs of the block in this graph, ln2's output u and the projections reading it, and the
        nodes reading u (or why there are no projections to fold into); found through the model as given and
        remembered from the first call: the parallelize switch moves what ln2 reads, and a tap may read u later."""
        if block.layer not in self._mlp_inputs:
            if self._before_values is None:
                self._before_values = values_by_name(self.before)
            found = projection.mlp_inputs(self.before, self._before_values, block)
            if not isinstance(found, str):
                u = self.values[found[0].name]
                found = (u, projection.reading(u, block.layer), {user for user, _ in u.uses()})
            self._mlp_inputs[block.layer] = found
        return self._mlp_inputs[block.layer]

    def output(self, block: BlockMap, branch: str) -> ir.Value:
        """What the residual add of `branch` ("attn" or "mlp") reads now: its output, or an earlier kind's choice."""
        return self._feeding.get((block.layer, branch), self.values[block.mlp_out if branch == "mlp" else block.attn_out])

    def choose(self, block: BlockMap, branch: str, on: ir.Value, built: list[ir.Node], edited: ir.Value, name: str,
               lazy: bool | None = None) -> None:
        """Make the residual add of `branch` read `edited` (computed by `built`) while `on`, else what it read:
        an If that computes `built` only while on (lazy), or a Where of both."""
        current = self.output(block, branch)
        if not (self.lazy if lazy is None else lazy):
            self.graph.extend(built)
            chosen = self.emitter("").op("Where", [on, edited, current], name)
        else:
            node = nodes.if_else(on, (built, edited), current, name)
            self.graph.append(node)
            chosen = node.outputs[0]
        for user, i in list(current.uses()):
            if user.op_type == "Add" and user not in built:  # the residual add, not the switch's own nodes
                user.replace_input_with(i, chosen)
        self._feeding[(block.layer, branch)] = chosen


def switchboard(
    model: ir.Model, kinds: list[Kind], fixes: dict[int, Fix] | None = None, taps: Taps | None = None, lazy: bool = True
) -> ir.Model:
    """A graph with per-layer run-time switches, one row of `surgery_switches` per kind (module docstring).

    fixes: the compensation fix of each layer ("compensate" switches it on; switch "parallelize" on too for the
    compensated parallel block). lazy: a branch edit is chosen by an If that computes it only while on; False:
    by a Where, computed always. The numbers are the same, except in float16 on CPU: ONNX Runtime keeps values
    in float32 between ops without float16 kernels but rounds them to float16 where they cross an If's boundary.
    """
    switches = [_switch_of(kind) for kind in kinds]
    blocks = find_blocks(model)
    before, model = model, model.clone()
    board = Board(model, fixes, taps is not None, lazy, before)
    g, n = model.graph, len(blocks)
    row = ir.Value(name=SWITCHES, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([len(kinds), n]))
    g.inputs.append(row)
    emit = board.emitter("surgery/switchboard")
    flat = emit.op("Reshape", [row, emit.const("flat_shape", np.array([-1], np.int64))], "flat")
    half = emit.const("half", np.array(0.5, np.float32))
    for k, (kind, (switch, args)) in enumerate(zip(kinds, switches)):
        for block in blocks:
            prefix = f"surgery/switchboard/{'_'.join(kind)}/blocks.{block.layer}"
            e = board.emitter(prefix)
            on = e.op("Greater", [e.op("Gather", [flat, e.const("index", np.array(k * n + block.layer, np.int64))], "switch"), half], "on")
            if taps is not None and kind == ("parallelize",) and not block.is_parallel:
                taps(board, block, on, prefix)
            switch(board, block, on, prefix, *args)
    g.sort()
    return model


def _switch_of(kind: Kind):
    p = PASSES.get(kind[0]) if kind else None
    if p is None or p.switch is None:
        offered = ", ".join(name for name, q in PASSES.items() if q.switch is not None)
        raise SurgeryError(f"no pass offers a switch {kind!r}; the switchable passes are {offered}")
    return p.switch, kind[1:]


def switches(kinds: list[Kind], n_layers: int, on: dict[Kind, set[int]] | None = None) -> np.ndarray:
    """The switchboard input with kind k on at the layers in on[kind]."""
    array = np.zeros((len(kinds), n_layers), np.float32)
    for kind, layers in (on or {}).items():
        array[kinds.index(kind), sorted(layers)] = 1.0
    return array
