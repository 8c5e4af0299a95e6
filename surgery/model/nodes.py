"""Values by name, and the node builders every graph edit shares: one way to add an op, a constant, a weight,
an If, a copy of nodes.

Small constants (axes, scalars, factors) are Constant nodes, so that they travel with the nodes that read
them (an If's branch can hold them); arrays the size of a weight are initializers of the main graph.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_ir as ir


class Emitter:
    """Adds nodes named `prefix/what` (or `what` when prefix is empty), each output named like its node:
    to the list `nodes`, which the caller places, or else at the end of `graph`."""

    def __init__(self, prefix: str = "", nodes: list[ir.Node] | None = None, graph: ir.Graph | None = None):
        if (nodes is None) == (graph is None):
            raise ValueError("an Emitter adds to a node list or to a graph: give one of them")
        self.prefix, self.nodes, self.graph = prefix, nodes, graph

    def name(self, what: str) -> str:
        return f"{self.prefix}/{what}" if self.prefix else what

    def op(self, op_type: str, inputs: list[ir.Value | None], what: str, num_outputs: int = 1, **attributes):
        """The op's output (a tuple of them when num_outputs > 1)."""
        node = ir.node(op_type, inputs, attributes=attributes, num_outputs=num_outputs, name=self.name(what))
        for i, value in enumerate(node.outputs):
            value.name = self.name(what if num_outputs == 1 else f"{what}_{i}")
        if self.nodes is not None:
            self.nodes.append(node)
        else:
            self.graph.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    def const(self, what: str, array) -> ir.Value:
        """A small constant, as a Constant node."""
        return self.op("Constant", [], what, value=ir.tensor(np.asarray(array), name=self.name(what)))


def if_else(cond: ir.Value, then: tuple[list[ir.Node], ir.Value], otherwise: ir.Value, name: str) -> ir.Node:
    """An If node named `name` whose output (named `name` too) is then[1], computed by the nodes then[0], when
    `cond`, else `otherwise` handed on through an Identity: the nodes of the branch not taken compute nothing."""
    nodes, out = then
    off = ir.node("Identity", [otherwise], name=f"{name}/off")
    off.outputs[0].name = f"{name}/off"
    branches = {
        "then_branch": ir.Graph([], [out], nodes=nodes, name=f"{name}/on"),
        "else_branch": ir.Graph([], off.outputs, nodes=[off], name=f"{name}/off"),
    }
    node = ir.node("If", [cond], attributes=branches, name=name)
    node.outputs[0].name = name
    return node


def initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer of `graph` holding `array` (weights, folded or switched)."""
    value = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(array), name=name))
    graph.register_initializer(value)
    return value


def copy(node: ir.Node, inputs: list[ir.Value | None], prefix: str) -> ir.Node:
    """A copy of `node` reading `inputs`, named prefix/<its name>; its outputs keep their types, named prefix/<theirs>."""
    new = ir.Node(
        node.domain, node.op_type, inputs, attributes=list(node.attributes.values()),
        num_outputs=len(node.outputs), name=f"{prefix}/{node.name}", overload=node.overload, version=node.version,
    )
    for original, out in zip(node.outputs, new.outputs):
        out.name = f"{prefix}/{original.name}"
        if original.type is not None:
            out.type, out.shape = original.type, original.shape
    return new


def copy_all(nodes: Iterable[ir.Node], mapping: dict[ir.Value, ir.Value], prefix: str) -> tuple[list[ir.Node], dict[ir.Value, ir.Value]]:
    """Copies of `nodes` (in the order given: producers first) reading mapping[v] wherever an original read v,
    and the mapping extended with every original output -> its copy."""
    mapping = dict(mapping)
    copies = []
    for node in nodes:
        new = copy(node, [None if x is None else mapping.get(x, x) for x in node.inputs], prefix)
        mapping.update(zip(node.outputs, new.outputs))
        copies.append(new)
    return copies, mapping


def values_by_name(model: ir.Model) -> dict[str, ir.Value]:
    """Every named value of the main graph: inputs, initializers, node outputs."""
    return {v.name: v for v in all_values(model.graph)}


def all_values(graph: ir.Graph) -> Iterable[ir.Value]:
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        yield from node.outputs
