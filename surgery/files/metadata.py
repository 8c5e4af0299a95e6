"""The metadata surgery writes into graphs and reads back, in one place: the keys of node metadata_props, the
model's history, and the pass names that other modules read off nodes."""

from __future__ import annotations

import json

import onnx_ir as ir

from surgery.errors import SurgeryError

PASS = "surgery.pass"  # node: which pass made or rewired it
LAYER = "surgery.layer"  # node: the block it belongs to
FIX = "surgery.fix"  # node: the output projection carries a folded fix (compensated / calibrated), its description
EDIT = "surgery.edit"  # node: it now produces a branch output, edited: what it computes ("mlp tangential")
UNFUSED = "surgery.unfused"  # node: JSON {"op", "name", "role"[, "epsilon"]} of the fused op it was split from on load
HISTORY = "surgery.history"  # model: JSON list of {"pass", "layers", "options", "version"}, oldest first
DECLARED = "surgery.declared"  # model, in memory only: JSON {input: dims} as the file declared them before load stated sizes

# Pass names read off nodes elsewhere: find_blocks tells a fused block by FUSE, saving splits the sums PARALLELIZE moved.
FUSE, PARALLELIZE = "fuse", "parallelize"


def tag(node: ir.Node, pass_name: str, layer: int) -> None:
    """Mark a node as made or rewired by a pass, so Netron and `inspect` show what was done."""
    node.metadata_props[PASS] = pass_name
    node.metadata_props[LAYER] = str(layer)


def made_by(node: ir.Node) -> str | None:
    """The pass that made or rewired `node`, if one did."""
    return node.metadata_props.get(PASS)


def history(model: ir.Model) -> list[dict]:
    """The surgery recorded in the model's metadata_props, oldest first."""
    raw = model.metadata_props.get(HISTORY)
    if not raw:
        return []
    try:
        entries = json.loads(raw)
    except json.JSONDecodeError:
        raise SurgeryError(f"metadata {HISTORY!r} is not valid JSON; the model was edited by another tool") from None
    return entries if isinstance(entries, list) else [entries]


def record(model: ir.Model, entry: dict) -> None:
    """Append one pass's entry to the model's history."""
    model.metadata_props[HISTORY] = json.dumps([*history(model), entry])


def describe(entry: dict) -> str:
    """One history entry in words: `parallelize layers=[3, 4] fused=True`."""
    extra = " ".join(f"{k}={v}" for k, v in (entry.get("options") or {}).items() if v is not None)
    return f"{entry.get('pass', '?')} layers={entry.get('layers')} {extra}".strip()
