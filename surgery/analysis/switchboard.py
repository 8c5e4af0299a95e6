"""The switchboard: one graph whose input `surgery_switches` [kinds, n_layers] turns, per layer and at run
time, a pass on (> 0.5) or off, so that one session measures every single-layer rewrite, or any set of them.

A kind is a Switch: a pass's name and its typed arguments, e.g. Switch("parallelize"),
Switch("ablate", Ablation("mlp", "tangential")), Switch("compensate", Compensation(fixes)). The switchboard builds
nothing itself and knows no pass by name: each kind's pass builds its own switch (Pass.switch) with the Board, so the
rewrite a session measures is the one the pass writes. A switch chooses exactly, with a Where, or with an If that
computes a branch edit only while it is on (lazy).

`taps` (compensation's fit) adds outputs at every block, with every kind's switch value, before any switch is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.model import nodes
from surgery.model.blocks import BlockMap, Branch
from surgery.model.nodes import Emitter, values_by_name
from surgery.model.subject import Subject
from surgery.passes import PASSES
from surgery.passes.common import float_dtype

SWITCHES = "surgery_switches"


@dataclasses.dataclass(frozen=True)
class Switch:
    """One row of the switchboard: the pass `name` with `args` (its Args, or None when it takes none)."""

    name: str
    args: Any = None


Taps = Callable[["Board", BlockMap, dict[Switch, ir.Value]], None]  # (board, block, each kind's switch value at it)


class Board:
    """The switchboard graph while it is built: what a pass's switch builds with. `prefix` names the nodes of the
    switch being built (surgery/switchboard/<k>.<pass>/blocks.<layer>)."""

    def __init__(self, model: ir.Model, lazy: bool, before: ir.Model, dtype: np.dtype):
        self.model, self.graph = model, model.graph
        self.before = before  # the model as given, before any switch or tap
        self.values = values_by_name(model)
        self.lazy = lazy
        self.dtype = dtype
        self.prefix = "surgery/switchboard"
        self._feeding: dict[tuple[int, str], ir.Value] = {}  # what each branch's residual add reads now
        self._shared: dict[Any, Any] = {}

    def emitter(self, prefix: str | None = None) -> Emitter:
        """Nodes named under `prefix` (the current switch's when None), appended to the graph."""
        return Emitter(self.prefix if prefix is None else prefix, graph=self.graph)

    def weight(self, name: str, array: np.ndarray) -> ir.Value:
        return nodes.initializer(self.graph, name, array)

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        """What every switch may read (a mask), or a pass remembers per block, made once."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def output(self, block: BlockMap, branch: Branch) -> ir.Value:
        """What the residual add of `branch` reads now: its output, or an earlier kind's choice."""
        return self._feeding.get((block.layer, branch), self.values[block.output(branch)])

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


def switchboard(model: "ir.Model | Subject", kinds: list[Switch], taps: Taps | None = None, lazy: bool = True) -> ir.Model:
    """A graph with per-layer run-time switches, one row of `surgery_switches` per kind (module docstring).

    lazy: a branch edit is chosen by an If that computes it only while on; False: by a Where, computed always. The
    numbers are the same, except in float16 on CPU: ONNX Runtime keeps values in float32 between ops without float16
    kernels but rounds them to float16 where they cross an If's boundary.
    """
    subject = Subject.of(model)
    passes = [_switchable(kind) for kind in kinds]
    blocks, n = subject.blocks, subject.n_layers
    board = Board(subject.model.clone(), lazy, subject.model, float_dtype(subject.model, stream=subject.stream))
    g = board.graph
    row = ir.Value(name=SWITCHES, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([len(kinds), n]))
    g.inputs.append(row)
    emit = board.emitter("surgery/switchboard")
    flat = emit.op("Reshape", [row, emit.const("flat_shape", np.array([-1], np.int64))], "flat")
    half = emit.const("half", np.array(0.5, np.float32))
    ons: dict[tuple[int, int], ir.Value] = {}
    for k, kind in enumerate(kinds):
        for block in blocks:
            e = board.emitter(f"surgery/switchboard/{k}.{kind.name}/blocks.{block.layer}")
            index = e.const("index", np.array(k * n + block.layer, np.int64))
            ons[k, block.layer] = e.op("Greater", [e.op("Gather", [flat, index], "switch"), half], "on")
    if taps is not None:
        for block in blocks:
            taps(board, block, {kind: ons[k, block.layer] for k, kind in enumerate(kinds)})
    for k, (kind, p) in enumerate(zip(kinds, passes)):
        for block in blocks:
            board.prefix = f"surgery/switchboard/{k}.{kind.name}/blocks.{block.layer}"
            p.switch(board, block, ons[k, block.layer], kind.args)
    g.sort()
    return board.model


def _switchable(kind: Switch):
    p = PASSES.get(kind.name)
    if p is None or p.switch is None:
        offered = ", ".join(name for name, q in PASSES.items() if q.switch is not None)
        raise SurgeryError(f"no pass offers a switch {kind.name!r}; the switchable passes are {offered}")
    return p


def switches(kinds: list[Switch], n_layers: int, on: dict[Switch, set[int]] | None = None) -> np.ndarray:
    """The switchboard input with kind k on at the layers in on[kind]."""
    array = np.zeros((len(kinds), n_layers), np.float32)
    for kind, layers in (on or {}).items():
        array[kinds.index(kind), sorted(layers)] = 1.0
    return array
