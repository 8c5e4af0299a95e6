"""Subject: a model read once per command, with what every pass and analysis asks of it.

A command reads its model once (`Subject.load` or `Subject.of`) and hands the subject along: its blocks are found
there (the only caller of find_blocks outside `inspect`), its values by name and its stream type are computed when
first asked for and kept until a rewrite changes the graph. The passes' driver clones it,
tells it what changed after each block's rewrite, and hands the rewritten subject back in the SurgeryResult, so the
next pass does not find the blocks again unless a rewrite moved them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.model.blocks import BlockMap, find_blocks
from surgery.model.embedding import embedding_table, stream_dtype
from surgery.model.nodes import values_by_name


@dataclasses.dataclass(eq=False)
class Subject:
    """A model and what is known of it: its blocks, its values by name, its stream type.

    Make one with `surgery.load` (or `Subject.load`), or wrap a model you hold with `Subject.of`; every pass takes
    it in place of a bare model, and a pass's `SurgeryResult.subject` is the rewritten one.

    Attributes:
        model: the model, in the plain view every pass works on (`graph.load`).
        where: how error messages name the model (its path, or "the graph").
    """

    model: ir.Model
    where: str = "the graph"
    _blocks: list[BlockMap] | None = None
    _values: dict[str, ir.Value] | None = None
    _stream: np.dtype | None = None
    _shared: dict[Any, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, model: "ir.Model | Subject", where: str = "the graph") -> "Subject":
        """`model` as a Subject (a Subject is returned as it is).

        Args:
            model: an `onnx_ir.Model`, or a Subject.
            where: how error messages name the model, for a bare model (usually its path).

        Returns:
            `model` itself when it is a Subject, else a new Subject of it (its blocks found when first asked for).
        """
        return model if isinstance(model, Subject) else cls(model, where)

    @classmethod
    def load(cls, path: str | Path) -> "Subject":
        """Read (and check) the model at `path` and find its blocks.

        Args:
            path: an .onnx file, or a folder holding one (`model.onnx`, or the folder's only .onnx file).

        Returns:
            The Subject, its blocks found; error messages name the model by `path`.

        Raises:
            SurgeryError: the path holds no ONNX model (or several .onnx files), the file is not a valid ONNX model,
                or the graph has no transformer blocks; one line naming the file.
        """
        from surgery.files import graph

        subject = cls(graph.load(path), str(path))
        subject.blocks  # noqa: B018  a graph with no blocks is refused here, naming the file
        return subject

    @property
    def graph(self) -> ir.Graph:
        """The model's main graph (`model.graph`)."""
        return self.model.graph

    @property
    def blocks(self) -> list[BlockMap]:
        """Every transformer block, in order (found on first use, and again after a rewrite that moves them).

        Returns:
            One `BlockMap` per layer, block i at index i.

        Raises:
            SurgeryError: the graph is not a decoder made of residual attention and mlp blocks (find_blocks).
        """
        if self._blocks is None:
            self._blocks = find_blocks(self.model, where=self.where)
        return self._blocks

    @property
    def n_layers(self) -> int:
        """How many transformer blocks (layers) the model has: `len(blocks)`."""
        return len(self.blocks)

    @property
    def values(self) -> dict[str, ir.Value]:
        """Every named value of the main graph, name -> `onnx_ir.Value` (kept until `changed`): a BlockMap's names
        (resid_pre, attn_out, ...) are keys of it."""
        if self._values is None:
            self._values = values_by_name(self.model)
        return self._values

    @property
    def stream(self) -> np.dtype:
        """The residual stream's NumPy float type (of the token embedding table)."""
        if self._stream is None:
            self._stream = np.dtype(stream_dtype(self.model).numpy())
        return self._stream

    @property
    def d_model(self) -> int:
        """The width of the residual stream: the token embedding table's second dimension (unpacked, when quantized).

        Raises:
            SurgeryError: the graph has no token embedding table to read it from.
        """
        table = embedding_table(self.model)
        if table is None:
            raise SurgeryError(f"found no token embedding table in {self.where} to read d_model from")
        return table[1]

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        """What a pass makes once per rewrite of this subject (a mask every block reads), made on first use.

        Args:
            key: what names it; the same key gives the same object until the subject is cloned.
            make: called, with no arguments, the first time `key` is asked for.

        Returns:
            What `make` returned for `key`.
        """
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def clone(self) -> "Subject":
        """A copy to rewrite (weights are shared, not copied); block maps are names, so they survive it.

        Returns:
            A new Subject of `model.clone()`, with the same `where`, blocks and stream type; values by name are found
            again when first asked for, and nothing `shared` is carried over.
        """
        return Subject(self.model.clone(), self.where, self._blocks, None, self._stream)

    def replace(self, block: BlockMap) -> None:
        """Block `block.layer` is now `block` (a rewrite that knows the new map, e.g. parallelize).

        Args:
            block: the block's new map; it replaces `blocks[block.layer]`.
        """
        blocks = list(self.blocks)
        blocks[block.layer] = block
        self._blocks = blocks

    def changed(self, blocks: bool = False) -> None:
        """The graph was rewritten: values by name are made again when next asked for, and the blocks too when
        `blocks` (a rewrite that renames stream values, e.g. fuse).

        Args:
            blocks: also find the blocks again when next asked for.
        """
        self._values = None
        if blocks:
            self._blocks = None
