"""The probe: a model that also outputs every block's resid_pre / attn_out / resid_mid / mlp_out / resid_post and,
for each sequential block, its ln2 + mlp evaluated a second time on resid_pre ("twin"), so the sequential-to-parallel
defect of all layers comes from one forward pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import onnx_ir as ir

from surgery.analysis import defect
from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.model import nodes
from surgery.model.blocks import branch_nodes
from surgery.model.embedding import stream_dtype
from surgery.model.nodes import values_by_name
from surgery.model.subject import Subject

TENSORS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")


@dataclasses.dataclass(frozen=True)
class Probe:
    """A probe graph and the output names it adds: outputs[layer][tensor] (tensor also `mlp_out_on_pre`)."""

    model: ir.Model
    outputs: tuple[dict[str, str], ...]


def probe(model: "ir.Model | Subject", tensors=TENSORS, twin: bool = True) -> Probe:
    """Tap the blocks' tensors and, with `twin`, add each sequential block's mlp(ln2(resid_pre))."""
    subject = Subject.of(model)
    blocks = subject.blocks
    model = subject.model.clone()
    values = values_by_name(model)
    outputs = []
    for block in blocks:
        names = {k: v for k, v in block.tensors().items() if k in tensors}
        if twin and not block.is_parallel:
            mapping = twin_branch(model.graph, branch_nodes(model, block, "mlp", values), {values[block.resid_mid]: values[block.resid_pre]},
                                  f"surgery/twin/blocks.{block.layer}")
            names["mlp_out_on_pre"] = mapping[values[block.mlp_out]].name
        outputs.append(names)
    model.graph.sort()
    _add_outputs(model, [name for names in outputs for name in names.values()], values_by_name(model))
    return Probe(model, tuple(outputs))


def tap(model: ir.Model, names: Iterable[str]) -> ir.Model:
    """A copy of `model` that also outputs the named values (weights shared, not copied)."""
    model = model.clone()
    _add_outputs(model, names, values_by_name(model))
    return model


def _add_outputs(model: ir.Model, names: Iterable[str], values: dict[str, ir.Value]) -> None:
    """Make the named values graph outputs too, in place."""
    present = {v.name for v in model.graph.outputs}
    dtype = None
    for name in names:
        if name in present:
            continue
        value = values.get(name)
        if value is None:
            raise SurgeryError(f"the graph has no value named {name!r}; check the name with `surgery inspect`")
        if value.dtype is None:  # optimum leaves intermediate values untyped
            value.dtype = dtype = dtype or stream_dtype(model)
        model.graph.outputs.append(value)
        present.add(name)


def twin_branch(g: ir.Graph, branch: set[ir.Node], mapping: dict[ir.Value, ir.Value], prefix: str) -> dict[ir.Value, ir.Value]:
    """Append a copy of the branch's nodes (in graph order) reading mapping[v] wherever they read v; returns the
    mapping of every original value to its copy."""
    copies, mapping = nodes.copy_all([node for node in g if node in branch], mapping, prefix)
    g.extend(copies)
    return mapping


def defect_scores(model: ir.Model, windows, options: runtime.Options = runtime.Options(), progress=None) -> dict[str, list[float | None]]:
    """C_l, C_l^stream and alpha_l of every block from one pass of the probe over `windows` (token 0 left out)."""
    p = probe(model, tensors=("mlp_out", "resid_post"), twin=True)
    sess = runtime.session(p.model, options)
    names = sorted({name for o in p.outputs if "mlp_out_on_pre" in o for name in o.values()})  # not the logits or the KV cache
    stats = defect.DefectStats(len(p.outputs))
    for i in range(len(windows)):
        out = dict(zip(names, sess.run(names, runtime.feeds(sess, windows.ids[i : i + 1]))))
        for layer, o in enumerate(p.outputs):
            if "mlp_out_on_pre" in o:
                stats.update(layer, out[o["mlp_out"]][0, 1:], out[o["mlp_out_on_pre"]][0, 1:], out[o["resid_post"]][0, 1:])
        if progress:
            progress(i + 1, len(windows))
    return stats.result()
