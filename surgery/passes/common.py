"""What every pass shares: the contract it declares (Pass), the record of what it changed (Change), its result,
and how new nodes are named.

A pass is a per-block rewrite with typed arguments. It declares, once, in its module:

    class Parallelize(Pass):
        name = "parallelize"
        def apply(self, subject, block, args) -> Change: ...            # the written rewrite of one block
        def switch(self, board: Board, block, on, args) -> None: ...    # the same edit behind a run-time switch

and registers one instance (`PARALLELIZE = register(Parallelize())`). The driver (surgery.passes.driver.apply_pass)
does the rest for every pass alike: it clones the model, checks the layers and every refusal before any work,
applies the passes named in `before` to each block first, loops over the blocks, tags each new node with the pass
and its block, finds the blocks again where a rewrite moved them, and records the model's history. A switch builds
with the Board: what it may use of the switchboard graph (surgery.analysis.switchboard implements it; the protocol is
here because the analysis stage sits above the passes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import onnx_ir as ir

from surgery.files import metadata
from surgery.model.blocks import BlockMap, Branch
from surgery.model.embedding import stream_dtype
from surgery.model.layers import checked
from surgery.model.nodes import Emitter
from surgery.version import __version__

if TYPE_CHECKING:
    from surgery.model.subject import Subject
    from surgery.passes.fix import Fix
    from surgery.passes.fold import Folded
    from surgery.passes.projection import Projection


@dataclasses.dataclass(frozen=True)
class Change:
    """One block's edit, or why the block was left alone.

    Attributes:
        layer: the block, by index from 0.
        what: the edit in words (`ln2 reads resid_pre`, `mlp tangential`), or why the block was left alone
            (`already parallel`).
        applied: the block was rewritten; False: it was left alone, as `what` says.
    """

    layer: int
    what: str
    applied: bool = True


@dataclasses.dataclass(frozen=True)
class SurgeryResult:
    """The rewritten model (a new object; the input is untouched), one Change per selected block, and the rewritten
    subject (its blocks as they are now: hand it to the next pass instead of the model).

    Attributes:
        model: the rewritten `onnx_ir.Model`; write it with `surgery.write` (or `save`), or measure it.
        changes: one Change per selected block, in layer order.
        subject: the rewritten Subject (its `.model` is `model`); None only when the result was made without one.
    """

    model: ir.Model
    changes: tuple[Change, ...]
    subject: "Subject | None" = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def changed_layers(self) -> tuple[int, ...]:
        """The layers whose Change was applied (the rest were left alone), in order."""
        return tuple(c.layer for c in self.changes if c.applied)


class Board(Protocol):
    """What a pass's switch may use of the switchboard graph while it is built (surgery.analysis.switchboard's
    Switchboard): the graph, its values by name and the stream's float type, the prefix that names the switch's
    nodes (surgery/switchboard/<k>.<pass>/blocks.<layer>), and the edits several switches share."""

    model: ir.Model
    graph: ir.Graph
    values: dict[str, ir.Value]
    dtype: np.dtype
    prefix: str

    def emitter(self, prefix: str | None = None) -> Emitter:
        """Nodes named under `prefix` (the current switch's when None), appended to the graph."""

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        """What every switch may read (a mask), or a pass remembers per block, made once."""

    def choose(self, block: BlockMap, branch: Branch, on: ir.Value, built: list[ir.Node], edited: ir.Value, name: str,
               lazy: bool | None = None) -> None:
        """The residual add of `branch` reads `edited` (computed by `built`) while `on`, else what it read."""

    def mlp_inputs(self, block: BlockMap) -> tuple[ir.Value, list[Projection], set[ir.Node]] | str:
        """ln2's output u, the projections an input side folds into and the nodes reading u; or why there are none."""

    def switch_weights(self, sides: Sequence[Folded], on: ir.Value, prefix: str | None = None) -> None:
        """Each folded projection computes with its new weight and bias while `on`, as before otherwise."""

    def input_fixed(self, e: Emitter, u: ir.Value, fix: Fix) -> ir.Value:
        """u (I + w_in) + b_in, the input side of `fix`, as explicit ops emitted through `e`."""

    def redirect(self, u: ir.Value, new: ir.Value, readers: set[ir.Node]) -> None:
        """The nodes in `readers` that read u read `new` instead."""

    def add_after_branch(self, block: BlockMap, fix: Fix, on: ir.Value) -> None:
        """resid_post gains attn_out w_a + mlp_out w_p + b (the output side of `fix`) while `on`, after the branch."""


class Pass:
    """A per-block rewrite (module docstring). Subclasses set `name` and define `apply`; the rest is optional.

    name: written into the graph (node metadata, the model's history) and how a switchboard names the pass.
    before: the passes (by name) the driver applies to each chosen block first, with their default arguments
        (compensate and fuse: parallelize).
    moves_blocks: a rewrite renames stream values of other blocks: the driver finds the blocks again after each.
    Args: the type of the pass's arguments (a frozen dataclass; NoArgs when it takes none).
    """

    name: ClassVar[str]
    before: ClassVar[tuple[str, ...]] = ()
    moves_blocks: ClassVar[bool] = False
    Args: ClassVar[type] = type(None)

    def refusal(self, subject: "Subject", block: BlockMap, args: Any) -> str | None:
        """Why `block` cannot take this rewrite (one line), or None; checked for every chosen block before any work."""
        return None

    def done(self, subject: "Subject", block: BlockMap, args: Any) -> str | None:
        """Why `block` is left alone because it has the rewrite already ("already parallel"), or None."""
        return None

    def apply(self, subject: "Subject", block: BlockMap, args: Any) -> Change:
        """Rewrite `block` in subject.model (already a copy); new nodes are tagged by the driver, nodes the rewrite
        rewires it tags itself (metadata.tag)."""
        raise NotImplementedError

    # def switch(self, board: Board, block, on, args) -> None: the same edit, chosen while the boolean value `on`;
    # None where the pass offers no switch
    switch: Callable[[Board, BlockMap, ir.Value, Any], None] | None = None

    def options(self, args: Any, layers: tuple[int, ...]) -> dict:
        """What the model's history records of `args` for the layers changed."""
        return {}

    def example(self, subject: "Subject", layers: Collection[int]) -> Any:
        """Arguments that make a visible edit of `layers` (the pass contract's tests run every pass with them)."""
        return None


PASSES: dict[str, Pass] = {}  # every pass module's Pass, by name (surgery.passes imports them all)


def register(p: Pass) -> Pass:
    """Make `p` known by its name: to the driver, the switchboard, and `inspect` through the history."""
    PASSES[p.name] = p
    return p


def float_dtype(model: ir.Model, value: ir.Value | None = None, stream: np.dtype | None = None) -> np.dtype:
    """The NumPy float type of `value` when the graph records it, else of the residual stream (`stream` when the
    caller knows it already: finding it scans the graph).

    Constants a pass adds take this type, so an fp16 graph stays fp16 (optimum leaves most
    intermediate values untyped; the token embedding table says what the stream is).
    """
    dtype = value.dtype if value is not None else None
    if dtype is None or not dtype.is_floating_point():
        return np.dtype(stream) if stream is not None else np.dtype(stream_dtype(model).numpy())
    return np.dtype(dtype.numpy())


def narrower_than_float32(dtype) -> bool:
    """fp16 / bf16: sums of squares over d_model overflow or lose digits there, so passes compute
    them in float32 between Casts, as the exporters' own normalisations do."""
    return np.dtype(dtype).itemsize < 4


def check_layers(layers: Collection[int], blocks: list[BlockMap]) -> set[int]:
    """Selected layers as non-negative indices; negative ones count from the end."""
    return {checked(layer, len(blocks)) for layer in layers}


def node_name(pass_name: str, layer: int, what: str) -> str:
    return f"surgery/{pass_name}/blocks.{layer}/{what}"


def record(model: ir.Model, pass_name: str, layers: Collection[int], options: dict) -> None:
    """Append a pass to the model's surgery history."""
    metadata.record(model, {"pass": pass_name, "layers": sorted(layers), "options": options, "version": __version__})
