"""What every pass shares: its result, the record of what it changed, and how new nodes are named."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection

import onnx_ir as ir

from surgery import __version__, graph
from surgery.blocks import BlockMap
from surgery.errors import SurgeryError

PASS_KEY = "surgery.pass"  # node metadata: which pass made or rewired the node
LAYER_KEY = "surgery.layer"


@dataclasses.dataclass(frozen=True)
class Change:
    """One block's edit, or why the block was left alone."""

    layer: int
    what: str
    applied: bool = True


@dataclasses.dataclass(frozen=True)
class SurgeryResult:
    """The rewritten model (a new object; the input is untouched) and one Change per selected block."""

    model: ir.Model
    changes: tuple[Change, ...]

    @property
    def changed_layers(self) -> tuple[int, ...]:
        return tuple(c.layer for c in self.changes if c.applied)


def check_layers(layers: Collection[int], blocks: list[BlockMap]) -> set[int]:
    """Selected layers as non-negative indices; negative ones count from the end."""
    n = len(blocks)
    chosen = set()
    for layer in layers:
        if not -n <= layer < n:
            raise SurgeryError(f"layer {layer} is out of range: the model has {n} blocks (0-{n - 1})")
        chosen.add(layer % n)
    return chosen


def tag(node: ir.Node, pass_name: str, layer: int) -> None:
    """Mark a node as made or rewired by a pass, so Netron and `inspect` show what was done."""
    node.metadata_props[PASS_KEY] = pass_name
    node.metadata_props[LAYER_KEY] = str(layer)


def node_name(pass_name: str, layer: int, what: str) -> str:
    return f"surgery/{pass_name}/blocks.{layer}/{what}"


def record(model: ir.Model, pass_name: str, layers: Collection[int], options: dict) -> None:
    """Append this pass to the model's surgery history (metadata_props, JSON)."""
    entries = graph.history(model)
    entries.append({"pass": pass_name, "layers": sorted(layers), "options": options, "version": __version__})
    model.metadata_props[graph.HISTORY_KEY] = json.dumps(entries)
