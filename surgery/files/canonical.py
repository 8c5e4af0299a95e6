"""The plain view of a graph that find_blocks and every pass work on, and back: passes composed on load
and on save.

On load (graph.load): KV cache inputs get the sizes the config states where the graph leaves them symbolic (on save
they are declared as the file declared them: `kv_cache_dim` stays a name);
each Skip(Simplified)LayerNormalization becomes its Add and its normalisation, so the residual stream is
Adds, as in an optimum export; a residual sum recomputed for a second normalisation is the sum itself.
On save (graph.save): each normalisation split on load is joined again to the Add it reads, so a rewritten
graph keeps the input's own ops; a sum a pass made two normalisations read is computed twice, so that ONNX
Runtime fuses both.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx_ir as ir

from surgery.files import config, metadata, ops


def on_load(model: ir.Model, folder: Path) -> ir.Model:
    """The plain view of a model read from `folder`, in place."""
    state_kv_sizes(model, folder)
    split_skip_norms(model)
    merge_repeated_sums(model)
    return model


def on_save(model: ir.Model) -> ir.Model:
    """The deployable form of a plain view, in place."""
    declare_as_read(model)
    join_skip_norms(model)
    split_shared_sums(model)
    return model


def state_kv_sizes(model: ir.Model, folder: Path) -> None:
    """Give KV cache inputs [batch, heads, past, head_size] whose heads or head size the graph leaves symbolic
    the sizes the model config beside it states, so that an empty cache can be fed; the dims the file declared are kept
    in the model's metadata (metadata.DECLARED) for `declare_as_read`. Without a config they stay symbolic and feeding
    an empty cache says what to do."""
    kv = [v for v in model.graph.inputs if v.name.startswith("past_key_values") and v.shape is not None and v.shape.rank() == 4]
    if not any(not isinstance(v.shape[i], int) for v in kv for i in (1, 3)):
        return
    sizes = config.kv_sizes(folder)
    if sizes is None:
        return
    declared = {}
    for value in kv:
        dims = list(value.shape)
        declared[value.name] = [d if isinstance(d, int) else d.value for d in dims]
        dims[1], dims[3] = sizes
        value.shape = ir.Shape(dims)
    model.metadata_props[metadata.DECLARED] = json.dumps(declared)


def declare_as_read(model: ir.Model) -> None:
    """Declare the inputs `state_kv_sizes` gave sizes as the file did (a name stays a name), in place: a rewritten
    graph keeps its input's interface exactly. The sizes are the same; only what the file says of them changes."""
    declared = json.loads(model.metadata_props.pop(metadata.DECLARED, "{}"))
    for value in model.graph.inputs:
        if value.name in declared and value.shape is not None and value.shape.rank() == len(declared[value.name]):
            value.shape = ir.Shape(declared[value.name])


def unfused_from(node: ir.Node) -> str | None:
    """The fused op `node` was split from by `split_skip_norms`, if it was."""
    raw = node.metadata_props.get(metadata.UNFUSED)
    return json.loads(raw)["op"] if raw else None


def split_skip_norms(model: ir.Model) -> int:
    """Split every Skip(Simplified)LayerNormalization whose mean and inverse-std outputs nobody reads into
    [bias Add,] Add and the plain normalisation, in place. Returns how many were split.

    The sum keeps the name of the op's output 3 when the graph exposes it (else `NAME/sum`), the
    normalised value keeps output 0's; the bias is added to the branch operand, the one that is not
    the residual stream (the other operand is computed from the stream, not the reverse).
    """
    graph = model.graph
    count = 0
    for node in list(graph):
        spec = ops.SKIP_NORMS.get(node.op_type) if node.domain == ops.MS else None
        if spec is None or any(_read(out) for out in node.outputs[1 : spec.sum_output]):
            continue
        eps = node.attributes.get("epsilon")
        tag = lambda role, **more: json.dumps({"op": node.op_type, "name": node.name, "role": role, **more})  # noqa: E731
        a, b = node.inputs[0], node.inputs[1]
        new = []
        bias = _input(node, spec.bias)
        if bias is not None:
            branch_first = not _computed_from(b, a)  # a is the branch unless b is computed from a
            target = a if branch_first else b
            add_bias = ir.node("Add", [target, bias], name=f"{node.name}/bias", metadata_props={metadata.UNFUSED: tag("bias")})
            add_bias.outputs[0].name = f"{node.name}/bias"
            new.append(add_bias)
            a, b = (add_bias.outputs[0], b) if branch_first else (a, add_bias.outputs[0])
        add = ir.node("Add", [a, b], name=f"{node.name}/add", metadata_props={metadata.UNFUSED: tag("sum")})
        add.outputs[0].name = f"{node.name}/sum"
        norm_inputs = [add.outputs[0], node.inputs[spec.scale]]
        if spec.beta is not None and _input(node, spec.beta) is not None:
            norm_inputs.append(node.inputs[spec.beta])
        norm = ir.node(  # computes with the fused op's epsilon; `epsilon` says whether the op stated it
            spec.norm, norm_inputs, name=f"{node.name}/norm", metadata_props={metadata.UNFUSED: tag("norm", epsilon=eps is not None)},
            attributes={"axis": -1, "epsilon": float(eps.value) if eps is not None else spec.epsilon, "stash_type": 1},
        )
        new += [add, norm]
        old_values, new_values = [node.outputs[0]], [norm.outputs[0]]
        if len(node.outputs) > spec.sum_output and node.outputs[spec.sum_output].name:
            old_values.append(node.outputs[spec.sum_output])
            new_values.append(add.outputs[0])
        for value in node.outputs[1:]:
            if value not in old_values:
                value.name = None
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, old_values, new_values)
        count += 1
    return count


def join_skip_norms(model: ir.Model) -> int:
    """The inverse of `split_skip_norms`, in place, for whatever passes did in between: each normalisation split
    from a fused op that reads a sum split from one becomes that fused op again (output 3 carries the sum
    when something else reads it). Two such normalisations reading one sum (a parallel block's ln1 and
    ln2) each become a fused op, the sum computed twice. Returns how many fused ops it wrote."""
    graph = model.graph
    count = 0
    for add in [n for n in graph if _role(n) == "sum"]:
        total = add.outputs[0]
        norms = [user for user, index in total.uses() if index == 0 and _role(user) == "norm" and user.op_type in _FUSED_FORM]
        if not norms:
            continue
        others = [user for user, _ in total.uses() if user not in norms]
        a, b, bias_node = add.inputs[0], add.inputs[1], None
        for i, operand in enumerate((a, b)):
            producer = operand.producer() if operand is not None else None
            if producer is not None and _role(producer) == "bias" and len(operand.uses()) == 1 and not operand.is_graph_output():
                bias_node = producer
                a, b = (producer.inputs[0], b) if i == 0 else (a, producer.inputs[0])
                break
        keeper = norms[0] if (others or total.is_graph_output()) else None
        for norm in norms:
            op = _FUSED_FORM[norm.op_type]
            spec = ops.SKIP_NORMS[op]
            inputs: list[ir.Value | None] = [a, b, norm.inputs[1]]
            if spec.beta is not None:
                inputs.append(norm.inputs[2] if len(norm.inputs) > 2 else None)
            if bias_node is not None:
                inputs += [None] * (spec.bias - len(inputs)) + [bias_node.inputs[1]]
            origin = json.loads(norm.metadata_props[metadata.UNFUSED])
            eps = float(norm.attributes["epsilon"].value)
            stated = origin.get("epsilon", True) or eps != spec.epsilon  # written back as read: absent when it was
            fused = ir.node(
                op, inputs, domain=ops.MS, num_outputs=spec.sum_output + 1 if norm is keeper else 1,
                name=origin["name"] + ("" if norm is norms[0] else f"/{len(norms)}"),
                attributes={"epsilon": eps} if stated else {},
            )
            old_values, new_values = [norm.outputs[0]], [fused.outputs[0]]
            if norm is keeper:
                old_values.append(total)
                new_values.append(fused.outputs[spec.sum_output])
            ir.convenience.replace_nodes_and_values(graph, norm, [norm], [fused], old_values, new_values)
            count += 1
        if not total.uses() and not total.is_graph_output():
            graph.remove(add, safe=True)
            if bias_node is not None and not bias_node.outputs[0].uses():
                graph.remove(bias_node, safe=True)
    if count:
        _import(model, ops.MS)
        graph.sort()
    for node in graph:
        node.metadata_props.pop(metadata.UNFUSED, None)
    return count


def split_shared_sums(model: ir.Model, moved_by: str = metadata.PARALLELIZE) -> int:
    """Where a pass made a normalisation read a residual sum that another normalisation reads too (a
    parallel block's ln2 reading resid_pre = the sum ln1 reads), give it its own copy of the Add, in place.

    ONNX Runtime fuses an Add into the one normalisation after it (SkipLayerNormalization) only when no
    other normalisation reads the sum; with a copy, both fuse. The copy adds its operands in the other
    order, so common-subexpression elimination does not merge it back; `merge_repeated_sums` does, on load.
    The nodes rewired by the pass are made_by `moved_by`. Returns the copies made."""
    graph = model.graph
    copies: dict[tuple[ir.Value, str], ir.Value] = {}
    for node in list(graph):
        if metadata.made_by(node) != moved_by:
            continue
        layer = node.metadata_props.get(metadata.LAYER, "")
        for index, value in enumerate(node.inputs):
            add = value.producer() if value is not None else None
            if add is None or add.op_type != "Add" or len(add.inputs) != 2 or any(x is None or x.const_value is not None for x in add.inputs):
                continue
            if all(metadata.made_by(user) == moved_by for user, _ in value.uses()):
                continue  # nothing else reads the sum: no fusion is lost
            if (value, layer) not in copies:
                copy = ir.node("Add", [add.inputs[1], add.inputs[0]], name=f"{add.name}/copy_for_blocks.{layer}")
                copy.outputs[0].name = f"{value.name}/copy_for_blocks.{layer}"
                copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
                graph.insert_after(add, [copy])
                copies[(value, layer)] = copy.outputs[0]
            node.replace_input_with(index, copies[(value, layer)])
    return len(copies)


def merge_repeated_sums(model: ir.Model) -> int:
    """Read every Add of two computed values that an earlier Add already computes (in either operand
    order) as that earlier sum, in place: a residual sum recomputed for a second normalisation
    (`split_shared_sums`, or two fused norms after the ORT optimizer) is one stream value. Returns how many."""
    graph = model.graph
    first: dict[frozenset, ir.Value] = {}
    merged = 0
    for node in list(graph):
        if node.op_type != "Add" or node.domain not in ops.STANDARD_DOMAINS or len(node.inputs) != 2 or None in node.inputs:
            continue
        if node.inputs[0] is node.inputs[1] or any(x.const_value is not None for x in node.inputs):
            continue
        key = frozenset(node.inputs)
        if key not in first:
            first[key] = node.outputs[0]
        elif not node.outputs[0].is_graph_output():
            ir.convenience.replace_all_uses_with(node.outputs[0], first[key])
            graph.remove(node, safe=True)
            merged += 1
    return merged


_FUSED_FORM = {spec.norm: op for op, spec in ops.SKIP_NORMS.items()}


def _role(node: ir.Node) -> str | None:
    raw = node.metadata_props.get(metadata.UNFUSED)
    return json.loads(raw)["role"] if raw else None


def _input(node: ir.Node, index: int | None) -> ir.Value | None:
    return node.inputs[index] if index is not None and index < len(node.inputs) else None


def _read(value: ir.Value) -> bool:
    return bool(value.name) and (bool(value.uses()) or value.is_graph_output())


def _computed_from(value: ir.Value | None, source: ir.Value | None) -> bool:
    """True when `value` is computed from `source` (walks producers back from `value`)."""
    seen: set[ir.Node] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        if v is None:
            continue
        if v is source:
            return True
        node = v.producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(node.inputs)
    return False


def _import(model: ir.Model, domain: str) -> None:
    model.opset_imports.setdefault(domain, 1)
