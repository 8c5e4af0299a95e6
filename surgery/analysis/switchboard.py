"""The switchboard: one graph whose input `surgery_switches` [kinds, n_layers] turns, per layer and at run
time, a pass on (> 0.5) or off, so that one session measures every single-layer rewrite, or any set of them.

A kind is a Switch: a pass's name and its typed arguments, e.g. Switch("parallelize"),
Switch("ablate", Ablation("mlp", "tangential")), Switch("compensate", Compensation(fixes)). The switchboard builds
nothing itself and knows no pass by name: each kind's pass builds its own switch (Pass.switch) with the Switchboard
(surgery.passes.common.Board, what a switch may use of it), so the rewrite a session measures is the one the pass
writes. A switch chooses exactly, with a Where, or with an If that computes a branch edit only while it is on (lazy).
The graph edits that several switches and the fit's taps share live here, on the Switchboard: folded weights chosen
while a switch is on, an input side as explicit ops, a fix added after the branch.

`taps` (compensation's fit) adds outputs at every block, with every kind's switch value, before any switch is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.model import nbits, nodes
from surgery.model.blocks import BlockMap, Branch
from surgery.model.nodes import Emitter, values_by_name
from surgery.model.subject import Subject
from surgery.passes import PASSES, Fix, fold, projection
from surgery.passes.common import float_dtype
from surgery.passes.fold import Folded
from surgery.passes.projection import Projection

SWITCHES = "surgery_switches"


@dataclasses.dataclass(frozen=True)
class Switch:
    """One row of the switchboard: the pass `name` with `args` (its Args, or None when it takes none)."""

    name: str
    args: Any = None


Taps = Callable[["Switchboard", BlockMap, dict[Switch, ir.Value]], None]  # (board, block, each kind's switch value at it)


class Switchboard:
    """The switchboard graph while it is built: what a pass's switch builds with (it implements
    surgery.passes.common.Board). `prefix` names the nodes of the switch being built
    (surgery/switchboard/<k>.<pass>/blocks.<layer>)."""

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
        """A new initializer `name` holding `array`."""
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

    def mlp_inputs(self, block: BlockMap) -> tuple[ir.Value, list[Projection], set[ir.Node]] | str:
        """fold.input_projections of the block in this graph: ln2's output u, the projections reading it and the nodes
        reading u (or why there are no projections to fold into); found through the model as given and remembered from
        the first call: the parallelize switch moves what ln2 reads, and a fit tap may read u later."""

        def find():
            found = fold.input_projections(self.before, self.shared("before_values", lambda: values_by_name(self.before)), block)
            if isinstance(found, str):
                return found
            u = self.values[found[0].name]
            return u, projection.reading(u, block.layer), {user for user, _ in u.uses()}

        return self.shared(("mlp_inputs", block.layer), find)

    def switch_weights(self, sides: Sequence[Folded], on: ir.Value, prefix: str | None = None) -> None:
        """Each projection of `sides` computes with its folded weight and bias (fold.folded's, as compensate writes
        them) while `on`, and as before otherwise; new nodes and weights are named under `prefix` (the switch's when
        None)."""
        prefix = self.prefix if prefix is None else prefix
        e = self.emitter(prefix)
        for side in sides:
            p, w, b, what = side.projection, side.weight, side.bias, side.what
            stored = self.weight(f"{prefix}/{what}/weight", w.T if p.transposed else w)
            bias = None if b is None else self.weight(f"{prefix}/{what}/bias", b)
            inner = p.unscaled  # where a bias the projection did not have is added
            if p.quant is not None:  # a second MatMulNBits: ORT computes one whose codes are not a constant differently
                chosen = self._quantized_switch(p, on, stored, bias, f"{prefix}/{what}")
                inner = chosen if inner is p.node.outputs[0] else inner
                if p.bias_site == (p.node, nbits.BIAS):
                    continue
            else:
                p.node.replace_input_with(1, e.op("Where", [on, stored, p.node.inputs[1]], f"{what}/weight_on"))
            if b is None:
                continue
            if p.bias_site is not None:
                node, i = p.bias_site
                node.replace_input_with(i, e.op("Where", [on, bias, node.inputs[i]], f"{what}/bias_on"))
                continue
            zeros = self.weight(f"{prefix}/{what}/no_bias", np.zeros(len(b), b.dtype))
            uses = list(inner.uses())
            added = e.op("Add", [inner, e.op("Where", [on, bias, zeros], f"{what}/bias_on")], f"{what}/out")
            for user, i in uses:
                user.replace_input_with(i, added)

    def _quantized_switch(self, p: Projection, on: ir.Value, codes: ir.Value, bias: ir.Value | None, prefix: str) -> ir.Value:
        """What read p.node's output reads, while `on`, the output of a copy of it with `codes` (and `bias`, when the
        node holds its bias), computed inside an If only then; returns the If's output."""
        inputs = list(p.node.inputs)
        inputs[nbits.B] = codes
        if bias is not None and p.bias_site == (p.node, nbits.BIAS):
            inputs[nbits.BIAS] = bias
        copy = nodes.copy(p.node, inputs, prefix)
        out = p.node.outputs[0]
        uses = list(out.uses())
        chosen = nodes.if_else(on, ([copy], copy.outputs[0]), out, f"{prefix}/chosen")
        self.graph.append(chosen)
        for user, i in uses:
            user.replace_input_with(i, chosen.outputs[0])
        return chosen.outputs[0]

    def input_fixed(self, e: Emitter, u: ir.Value, fix: Fix) -> ir.Value:
        """u (I + w_in) + b_in as explicit ops (emitted through `e`): the input side of `fix` where a graph must keep u
        itself, because a fit tap reads it."""
        fixed = u
        if fix.w_in is not None:
            w = self.weight(e.name("w_in"), np.asarray(fix.w_in, self.dtype))
            fixed = e.op("Add", [u, e.op("MatMul", [u, w], "times_w_in")], "plus_w_in")
        if fix.b_in is not None:
            fixed = e.op("Add", [fixed, self.weight(e.name("b_in"), np.asarray(fix.b_in, self.dtype))], "plus_b_in")
        return fixed

    def redirect(self, u: ir.Value, new: ir.Value, readers: set[ir.Node]) -> None:
        """The nodes in `readers` that read u read `new` instead."""
        for user, i in list(u.uses()):
            if user in readers:
                user.replace_input_with(i, new)

    def add_after_branch(self, block: BlockMap, fix: Fix, on: ir.Value) -> None:
        """The residual add of the mlp branch reads it plus attn_out w_a + mlp_out w_p + b (the output side of `fix`;
        terms that are None left out) while `on`: what reads attn_out and mlp_out sees them unfixed (the fit's taps)."""
        attn_out, mlp_out, dtype, prefix = self.values[block.attn_out], self.values[block.mlp_out], self.dtype, self.prefix
        built: list[ir.Node] = []
        e = Emitter(prefix, nodes=built)
        total = self.output(block, "mlp")
        if fix.w_a is not None:
            w = self.weight(f"{prefix}/w_a", np.asarray(fix.w_a, dtype))
            total = e.op("Add", [total, e.op("MatMul", [attn_out, w], "attn_fix")], "plus_attn_fix")
        if fix.w_p is not None:
            w = self.weight(f"{prefix}/w_p", np.asarray(fix.w_p, dtype))
            total = e.op("Add", [total, e.op("Mul" if np.ndim(fix.w_p) == 0 else "MatMul", [mlp_out, w], "mlp_fix")], "plus_mlp_fix")
        if fix.b is not None:
            total = e.op("Add", [total, self.weight(f"{prefix}/b", np.asarray(fix.b, dtype))], "plus_b")
        self.choose(block, "mlp", on, built, total, f"{prefix}/chosen", lazy=False)


def switchboard(model: "ir.Model | Subject", kinds: list[Switch], taps: Taps | None = None, lazy: bool = True) -> ir.Model:
    """A graph with per-layer run-time switches, one row of `surgery_switches` per kind (module docstring).

    lazy: a branch edit is chosen by an If that computes it only while on; False: by a Where, computed always. The
    numbers are the same, except in float16 on CPU: ONNX Runtime keeps values in float32 between ops without float16
    kernels but rounds them to float16 where they cross an If's boundary.
    """
    subject = Subject.of(model)
    passes = [_switchable(kind) for kind in kinds]
    blocks, n = subject.blocks, subject.n_layers
    board = Switchboard(subject.model.clone(), lazy, subject.model, float_dtype(subject.model, stream=subject.stream))
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
