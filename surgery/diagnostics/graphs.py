"""Read-only diagnostic graphs built from an exported model. None of them is meant for deployment.

- probe: taps every block's resid_pre / attn_out / resid_mid / mlp_out / resid_post and, for each
  sequential block, also evaluates its ln2 + mlp a second time on resid_pre ("twin"), so the
  sequential-to-parallel defect of all layers comes from one forward pass.
- switchboard: one graph whose input `surgery_switches` [kinds, n_layers] turns, per layer and at
  run time, the parallel form or a branch edit on (> 0.5) or off, choosing exactly with Where. One
  session then measures every single-layer rewrite.
- field: one block's mlp(ln2(z)) for any z, for the critical points of the mlp field.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery import graph
from surgery.blocks import BlockMap, branch_nodes, find_blocks
from surgery.graph import values_by_name
from surgery.passes.parallel import redirect
from surgery.passes.project import edit_nodes

SWITCHES, FIELD_IN, FIELD_OUT = "surgery_switches", "surgery_z", "surgery_field"
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


def switchboard(model: ir.Model, kinds: list[tuple[str, ...]]) -> ir.Model:
    """A graph with per-layer run-time switches. kinds: ("parallel",) or (branch, mode) as in `project`."""
    blocks = find_blocks(model)
    model = model.clone()
    g = model.graph
    values = values_by_name(model)
    dtype = graph.stream_dtype(model).numpy()
    n = len(blocks)
    switches = ir.Value(name=SWITCHES, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([len(kinds), n]))
    g.inputs.append(switches)
    flat = _op(g, "Reshape", [switches, _const(g, "surgery/switchboard/flat_shape", np.array([-1], np.int64))], "surgery/switchboard/flat")
    half = _const(g, "surgery/switchboard/half", np.array(0.5, np.float32))
    feeding: dict[tuple[int, str], ir.Value] = {}  # what each branch's residual add reads now
    for k, kind in enumerate(kinds):
        for block in blocks:
            prefix = f"surgery/switchboard/{'_'.join(kind)}/blocks.{block.layer}"
            index = _const(g, f"{prefix}/index", np.array(k * n + block.layer, np.int64))
            on = _op(g, "Greater", [_op(g, "Gather", [flat, index], f"{prefix}/switch"), half], f"{prefix}/on")
            if kind == ("parallel",):
                if block.is_parallel:
                    continue
                mid, pre = values[block.resid_mid], values[block.resid_pre]
                chosen = _op(g, "Where", [on, pre, mid], f"{prefix}/mlp_in")
                redirect(g, branch_nodes(model, block, "mlp"), mid, chosen, block.layer, "switchboard")
            else:
                branch, mode = kind
                out = values[block.mlp_out if branch == "mlp" else block.attn_out]
                ref = values[block.mlp_in if branch == "mlp" else block.resid_pre]
                nodes, edited = edit_nodes(out, ref, mode, None, prefix, dtype)
                g.extend(nodes)
                current = feeding.get((block.layer, branch), out)
                chosen = _op(g, "Where", [on, edited, current], f"{prefix}/chosen")
                for user, i in list(current.uses()):
                    if user.op_type == "Add" and user not in nodes:
                        user.replace_input_with(i, chosen)
                feeding[(block.layer, branch)] = chosen
    g.sort()
    return model


def switches(kinds: list[tuple[str, ...]], n_layers: int, on: dict[tuple[str, ...], set[int]] | None = None) -> np.ndarray:
    """The switchboard input with kind k on at the layers in on[kind]."""
    array = np.zeros((len(kinds), n_layers), np.float32)
    for kind, layers in (on or {}).items():
        array[kinds.index(kind), sorted(layers)] = 1.0
    return array


def field(model: ir.Model, block: BlockMap) -> ir.Model:
    """A graph from `surgery_z` [batch, pos, d_model] to `surgery_field` = mlp(ln2(z)) of one block."""
    model = model.clone()
    g = model.graph
    values = values_by_name(model)
    z = ir.Value(name=FIELD_IN, type=ir.TensorType(graph.stream_dtype(model)), shape=ir.Shape(["batch", "pos", "d_model"]))
    g.inputs.append(z)
    mapping = _copy(g, branch_nodes(model, block, "mlp"), {values[block.mlp_in]: z}, f"surgery/field/blocks.{block.layer}")
    out = mapping[values[block.mlp_out]]
    out.name = FIELD_OUT
    g.sort()
    g.outputs.clear()
    g.outputs.append(out)
    if out.dtype is None:
        out.dtype = z.dtype
    RemoveUnusedNodesPass()(model)
    used = [v for v in g.inputs if v.uses()]
    g.inputs.clear()
    g.inputs.extend(used)
    return model


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
