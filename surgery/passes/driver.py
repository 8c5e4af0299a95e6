"""The one driver every pass runs through: apply_pass(model, pass, layers, args) -> SurgeryResult.

It clones the model (weights are shared, not copied), checks the layers and every refusal before any work, and for
each chosen block in order applies the passes the pass names in `before` and then the pass itself: a block that has
a rewrite already is reported and left alone (Pass.done), each new node is tagged with the pass and its block, and
the blocks are found again after each block of a pass that moves other blocks (fuse), and once more, lazily, by the
next pass that reads the result's subject. Each pass that changed a block appends to the model's
history. Passes compose through it: compensate and fuse parallelize first; the main job chains fuse after
compensate by handing the first result's subject to the second.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import onnx_ir as ir
from threadpoolctl import threadpool_limits

from surgery.errors import SurgeryError
from surgery.files.metadata import PASS, tag
from surgery.model.subject import Subject
from surgery.passes.common import PASSES, Change, Pass, SurgeryResult, check_layers, record


def apply_pass(model: "ir.Model | Subject", p: Pass | str, layers: Collection[int], args: Any = None) -> SurgeryResult:
    """Apply pass `p` (or its name) with `args` to the blocks `layers` (negative ones count from the end) of a copy of
    `model`; the input is not modified. Exported as `surgery.apply_pass`.

    Each chosen block, in layer order, first gets the passes `p` names in `before` (compensate and fuse: parallelize)
    and then `p`; a block that has the rewrite already is reported and left alone. New nodes are tagged with the pass
    and the block, and each pass that changed a block appends to the model's history.

    Args:
        model: an `onnx_ir.Model`, or a Subject (from `load`, or a result's `.subject`: its blocks are not found again).
        p: a registered pass or its name: `parallelize`, `compensate`, `ablate`, `fuse` (surgery.passes.PASSES).
        layers: the blocks to rewrite, by index from 0; negative ones count from the end.
        args: the pass's arguments, of its `Args` type (e.g. `Ablation("mlp", "remove")`); None for a pass that takes
            none (parallelize) or where its defaults do (fuse).

    Returns:
        A SurgeryResult: the new model, one Change of `p` per chosen block in layer order, and the rewritten subject.

    Raises:
        SurgeryError: no pass of that name, a layer out of range, or a chosen block the pass (or one it runs first)
            refuses, all before any work; or a rewrite that fails on a block (the input is untouched then too).
    """
    p = _named(p)
    subject = Subject.of(model).clone()
    chosen = sorted(check_layers(layers, subject.blocks))
    chain = [(_named(name), None) for name in p.before] + [(p, args)]
    for layer in chosen:
        for q, q_args in chain:
            if (why := q.refusal(subject, subject.blocks[layer], q_args)) is not None:
                raise SurgeryError(why)
    changes: dict[str, list[Change]] = {q.name: [] for q, _ in chain}
    with threadpool_limits(1, user_api="blas"):  # weights folded by one BLAS thread: the same bytes on any machine's thread count
        for layer in chosen:
            for q, q_args in chain:
                changes[q.name].append(_apply(subject, q, layer, q_args))
    for q, q_args in chain:
        done = tuple(c.layer for c in changes[q.name] if c.applied)
        if done:
            record(subject.model, q.name, done, q.options(q_args, done))
            subject.changed(blocks=True)  # a rewritten block's map (its outputs, its fix) is found again when next asked for
    return SurgeryResult(subject.model, tuple(changes[p.name]), subject)


def _apply(subject: Subject, p: Pass, layer: int, args: Any) -> Change:
    """One pass on one block: left alone when it has the rewrite already, else applied and its new nodes tagged."""
    block = subject.blocks[layer]
    if (why := p.done(subject, block, args)) is not None:
        return Change(layer, why, applied=False)
    before = set(subject.graph)
    change = p.apply(subject, block, args)
    for node in subject.graph:
        if node not in before and PASS not in node.metadata_props:
            tag(node, p.name, layer)
    subject.changed(blocks=p.moves_blocks)
    return change


def _named(p: Pass | str) -> Pass:
    if isinstance(p, Pass):
        return p
    if p not in PASSES:
        raise SurgeryError(f"no pass named {p!r}; the passes are {', '.join(sorted(PASSES))}")
    return PASSES[p]
