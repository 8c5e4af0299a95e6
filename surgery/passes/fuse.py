"""fuse: the parallel block computed with one normalisation and two MatMuls.

    n = normalize(resid_pre)                                  # no scale, no bias
    [q | k | v | gate | up] = n @ [g1*W_q | g1*W_k | g1*W_v | g2*W_gate | g2*W_up] + b
    attn_out + mlp_out = [o_in | mlp_hidden] @ [W_o ; W_down] + (b_o + b_down)
    resid_post = resid_pre + that

Each ln's scale g (and LayerNorm bias b: b @ W) is folded into the weights, so the function equals
parallel(l) up to float error. Attention internals (heads, rotary, KV cache, mask) are untouched:
only the projections that read ln1 / ln2 and the two output projections are replaced. On MatMulNBits
weights nothing is requantized (_nbits_in, _nbits_out) unless a fix is folded in: the ln scales stay Muls, and the
projections reading each ln become one MatMulNBits, [o ; down] another. A fix is folded by surgery.passes.fold,
as compensate folds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery.errors import SurgeryError
from surgery.files import metadata
from surgery.files.metadata import tag
from surgery.model import nbits, nodes
from surgery.model.blocks import BlockMap, block_norms, branch_nodes
from surgery.model.nodes import Emitter, values_by_name
from surgery.passes import fold, projection
from surgery.passes.common import Change, Pass, SurgeryResult, narrower_than_float32, node_name, register
from surgery.passes.driver import apply_pass
from surgery.passes.fix import Fix

NAME = metadata.FUSE  # find_blocks tells a fused block by it


@dataclasses.dataclass(frozen=True)
class Fusion:
    """Per layer, a linear fix folded into [W_o ; W_down] and the output bias (see compensate): the compensated, or
    with Fix.gate(alpha) the calibrated, fused parallel block; a layer without one is fused plain."""

    fixes: Mapping[int, Fix] = dataclasses.field(default_factory=dict, compare=False)


class Fuse(Pass):
    """Rewrite each selected block into the fused parallel form (module docstring); sequential blocks are
    parallelized first."""

    name = NAME
    before = (metadata.PARALLELIZE,)
    moves_blocks = True  # fusing a block renames the next block's resid_pre
    Args = Fusion

    def refusal(self, subject, block: BlockMap, args: Fusion | None) -> str | None:
        return refusal(subject.model, block, subject.values)

    def done(self, subject, block: BlockMap, args: Fusion | None) -> str | None:
        return "already fused" if block.fused else None

    def apply(self, subject, block: BlockMap, args: Fusion | None) -> Change:
        fixes = args.fixes if args is not None else {}
        _fuse_block(subject.model, block, subject.values, fixes.get(block.layer, Fix()))
        RemoveUnusedNodesPass()(subject.model)  # the old ln, projections and residual adds
        subject.graph.sort()
        return Change(block.layer, "one normalisation, [q|k|v|mlp in] and [o ; mlp out] MatMuls")

    def options(self, args: Fusion | None, layers) -> dict:
        fixes = args.fixes if args is not None else {}
        fixed = {str(k): v.describe() for k, v in sorted(fixes.items()) if k in layers and not v.is_identity}
        return {"fixes": fixed} if fixed else {}

    def example(self, subject, layers) -> Fusion:
        return Fusion()


FUSE = register(Fuse())


def fuse(model, layers: Collection[int], fixes: Mapping[int, Fix] | None = None) -> SurgeryResult:
    """Rewrite each selected block into the fused parallel form (Fuse); `fixes`: see Fusion.

    One normalisation of resid_pre feeds one MatMul of [q | k | v | mlp in], and one MatMul of [o ; mlp out] computes
    attn_out + mlp_out, the ln scales (and LayerNorm biases) folded into the weights (on MatMulNBits weights the scales
    stay Muls): the parallel block up to float error (module docstring). Sequential blocks are parallelized first; a fused block is reported and left alone.

    Args:
        model (ir.Model | Subject): an `onnx_ir.Model`, or a Subject (from `load`, or a result's `.subject`); it is not modified.
        layers: the blocks to fuse, by index from 0; negative ones count from the end.
        fixes: layer (from 0) -> a Fix folded into [W_o ; W_down] and the output bias, as `compensate` folds it:
            the compensated fused block, or with Fix.gate(alpha) the calibrated one. Selected layers without one are
            fused plain; fixes of other layers are not used.

    Returns:
        A SurgeryResult: the new model, one Change per selected block in order, and the rewritten subject (its
        blocks found again: fusing a block renames the next block's resid_pre).

    Raises:
        SurgeryError: before any work, a layer out of range or a block that cannot be fused (its normalisations or
            projections not of a form the pass reads, ln1 and ln2 of different kinds or epsilons, branch outputs that
            are normalised, MatMulNBits weights it cannot join without requantizing); while rewriting, a fix with an
            mlp input side on a MatMulNBits block.
    """
    return apply_pass(model, FUSE, layers, Fusion(dict(fixes or {})))


def refusal(model: ir.Model, block: BlockMap, values: dict[str, ir.Value] | None = None) -> str | None:
    """Why `block` cannot be fused, or None; read from the graph before any work (no weight is loaded)."""
    if block.fused:
        return None  # fuse says it is already fused
    why = fold.refusal(model, block, "fuse", "attn_out and mlp_out cannot come from one [o ; down] MatMul; "
                       "parallelize it without --fuse")
    if why is not None:
        return why
    values = values if values is not None else values_by_name(model)
    try:
        ln1, ln2 = block_norms(model, block, values)
        if _quantized(model, block, values):
            if (why := _nbits_refusal(block, values, ln1, ln2)) is not None:
                return why
        else:
            for ln in (ln1, ln2):
                projection.reading(values[ln.output], block.layer)
            projection.outputs(values, block)
    except SurgeryError as e:
        return str(e)
    if ln1.kind != ln2.kind:
        return f"cannot fuse block {block.layer}: ln1 is {ln1.kind} but ln2 is {ln2.kind}"
    if ln1.eps is None or ln1.eps != ln2.eps:
        what = "is not one constant" if ln1.eps is None or ln2.eps is None else f"of ln1 ({ln1.eps:g}) and ln2 ({ln2.eps:g}) differ"
        return f"cannot fuse block {block.layer}: the normalisations' epsilon {what}, and the fused block has one; parallelize it without --fuse"
    return None


def _quantized(model: ir.Model, block: BlockMap, values: dict[str, ir.Value] | None = None) -> bool:
    return any(n.op_type == nbits.OP for branch in ("attn", "mlp") for n in branch_nodes(model, block, branch, values))


def _readers(source: ir.Value) -> list[tuple[ir.Node, int]]:
    """What reads an ln output, but for shape arithmetic."""
    return [(user, i) for user, i in source.uses() if user.op_type != "Shape"]


def _attrs(node: ir.Node) -> tuple[int, int, int]:
    """(bits, block_size, accuracy_level): what MatMulNBits nodes must share to be one."""
    a = {k: v.value for k, v in node.attributes.items()}
    return a.get("bits", 4), a["block_size"], a.get("accuracy_level", 0)


def _nbits_refusal(block: BlockMap, values: dict[str, ir.Value], ln1, ln2) -> str | None:
    """Why a block of MatMulNBits projections cannot be fused without requantizing, or None; no weight is read."""
    layer = block.layer
    for which, ln in (("ln1", ln1), ("ln2", ln2)):
        readers = _readers(values[ln.output])
        plain = [u for u, i in readers if u.op_type != nbits.OP or i != 0]
        if plain:
            return (f"cannot fuse block {layer}: {which}'s output feeds {plain[0].op_type} {plain[0].name!r} beside MatMulNBits "
                    "projections; parallelize it without --fuse")
        if len({_attrs(u) for u, _ in readers}) > 1:
            return (f"cannot fuse block {layer}: the MatMulNBits projections reading {which} differ in bits, block size or "
                    "accuracy level, so they cannot be one; parallelize it without --fuse")
    o_proj, down = projection.quantized_node(values[block.attn_out]), projection.quantized_node(values[block.mlp_out])
    if o_proj is None or down is None:
        return f"cannot fuse block {layer}: its output projections mix MatMulNBits and float weights; parallelize it without --fuse"
    (bits, block_size, level), k_o = _attrs(o_proj), o_proj.attributes["K"].value
    if _attrs(down) != (bits, block_size, level):
        return (f"cannot fuse block {layer}: W_o and W_down differ in bits, block size or accuracy level, so [o ; down] cannot "
                "be one MatMulNBits; parallelize it without --fuse")
    if k_o % block_size:
        return (f"cannot fuse block {layer}: W_o's K ({k_o}) is not a multiple of its block size ({block_size}), so [o ; down] "
                "cannot be one MatMulNBits along K without requantizing; parallelize it without --fuse")
    return None


def _fuse_block(model: ir.Model, block: BlockMap, values: dict[str, ir.Value], fix: Fix) -> None:
    """Replace the block's two normalisations, its projections and its residual adds by the fused form (module
    docstring): one normalisation of resid_pre, the in-projection (`_float_in` or `_nbits_in`), the out-projection
    [o ; down] (`_float_out` or `_nbits_out`) with the fix's output side folded in, and its bias; new nodes tagged."""
    g, layer = model.graph, block.layer
    ln1, ln2 = block_norms(model, block, values)
    quantized = _quantized(model, block, values)
    if quantized and fix.fixes_input:  # folded into W_gate / W_up (their codes chosen again, as compensate does) before they are joined
        for side in fold.folded(fix, inputs=projection.reading(values[ln2.output], layer)):
            fold.set_weights(g, side, node_name(NAME, layer, side.what))
    x = values[block.resid_pre]
    for ln in (ln1, ln2):
        for user, index in list(values[ln.output].uses()):
            if user.op_type == "Shape":  # shape arithmetic: the ln output has resid_pre's shape
                user.replace_input_with(index, x)
    attn_out, mlp_out = projection.outputs(values, block)
    inputs = [] if quantized else [(p, ln) for ln in (ln1, ln2) for p in projection.reading(values[ln.output], layer)]
    # the type of the new weights and of the norm's constants: the graph's (fp16 stays fp16)
    dtype = attn_out.quant.dtype if quantized else np.result_type(*(p.weight for p, _ in inputs))

    built: list[ir.Node] = []
    e = Emitter(node_name(NAME, layer, "").rstrip("/"), nodes=built)
    const = lambda what, array: nodes.initializer(g, e.name(what), array)  # noqa: E731  weights-sized: initializers
    n = _normalize(e.op, const, x, ln1, int(values[ln1.scale].shape[0]), dtype)  # [batch, pos, d_model]
    if quantized:
        _nbits_in(g, e, const, n, (ln1, ln2), values)
    else:
        _float_in(e, const, n, inputs, fix, ln2, values, dtype)
    hidden = e.op("Concat", [attn_out.input, mlp_out.input], "out_proj_input", axis=-1)  # [batch, pos, d_attn + d_mlp]
    both, b_out = (_nbits_out if quantized else _float_out)(e, const, hidden, attn_out, mlp_out, fix)
    if not fix.is_identity:
        both.producer().metadata_props[metadata.FIX] = fix.describe()
    if b_out is not None:
        both = e.op("Add", [both, const("b_out", b_out)], "out_proj_bias")
    post = e.op("Add", [x, both], "resid_post")
    for node in built:
        tag(node, NAME, layer)
    g.extend(built)
    values[block.resid_post].replace_all_uses_with(post, replace_graph_outputs=True)


def _float_in(e: Emitter, const, n: ir.Value, inputs: list, fix: Fix, ln2, values: dict[str, ir.Value], dtype) -> None:
    """What read ln1 and ln2 reads pieces of one MatMul of the norm n, [q | k | v | gate | up]: each ln's scale
    (and LayerNorm bias: b @ W) folded into the weights of the projections reading it, and the fix's input side into
    those reading ln2 first; folded in float64, rounded once to `dtype`."""
    array = lambda name: values[name].const_value.numpy().astype(np.float64)  # noqa: E731  an ln scale or bias

    def scaled_by(ln, p: projection.Projection) -> tuple[np.ndarray, np.ndarray]:
        """p's weight [in, out] and bias [out] as p would read ln's scale and bias."""
        weight, bias = fold.input_weights(fix, p) if ln is ln2 else (p.weight.astype(np.float64), p.bias)  # the fix's input side first
        bias = np.zeros(weight.shape[1]) if bias is None else bias.astype(np.float64)
        if ln.bias is not None:
            bias = bias + array(ln.bias) @ weight
        return array(ln.scale)[:, None] * weight, bias

    weights = [scaled_by(ln, p) for p, ln in inputs]
    w_in = np.concatenate([w for w, _ in weights], axis=1).astype(dtype)
    b_in = np.concatenate([b for _, b in weights]).astype(dtype)
    projected = e.op("MatMul", [n, const("w_in", w_in)], "in_proj")
    if np.any(b_in):
        projected = e.op("Add", [projected, const("b_in", b_in)], "in_proj_bias")
    sizes = const("split_sizes", np.array([p.weight.shape[1] for p, _ in inputs], dtype=np.int64))
    pieces = e.op("Split", [projected, sizes], "split", num_outputs=len(inputs), axis=-1)
    pieces = pieces if isinstance(pieces, (list, tuple)) else [pieces]
    for (p, _), piece in zip(inputs, pieces):
        p.output.replace_all_uses_with(piece)


def _nbits_in(g: ir.Graph, e: Emitter, const, n: ir.Value, lns: tuple, values: dict[str, ir.Value]) -> None:
    """What read each ln reads the norm n times its scale (plus its bias), through one MatMulNBits of the projections
    reading it, [q|k|v] and [gate|up] (rows, scales and zero points concatenated along N; a GenAI qkv_proj is one
    already): without requantizing, as an ln scale varies along K inside a quantization block."""
    for which, ln in zip(("ln1", "ln2"), lns):
        scaled = e.op("Mul", [n, values[ln.scale]], f"{which}_scale")
        if ln.bias is not None:
            scaled = e.op("Add", [scaled, values[ln.bias]], f"{which}_bias")
        readers = [u for u, _ in _readers(values[ln.output])]
        if len(readers) == 1:  # one projection already (GenAI's qkv_proj): it reads the scaled norm as it is
            readers[0].replace_input_with(0, scaled)
            continue
        one = _concatenated(g, readers, scaled, e.name(f"{which}_proj"))
        e.nodes.append(one)
        sizes = const(f"{which}_split_sizes", np.array([u.attributes["N"].value for u in readers], dtype=np.int64))
        pieces = e.op("Split", [one.outputs[0], sizes], f"{which}_split", num_outputs=len(readers), axis=-1)
        for reader, piece in zip(readers, pieces):
            reader.outputs[0].replace_all_uses_with(piece)


def _float_out(e: Emitter, const, hidden: ir.Value, attn_out: projection.Projection, mlp_out: projection.Projection, fix: Fix
               ) -> tuple[ir.Value, np.ndarray | None]:
    """hidden @ [W_o ; W_down] with the fix folded in, and the summed bias (None where it is 0): the fold in float64,
    times each output's scale (a residual multiplier goes into the fused weights), rounded once to the weights' type."""
    o_proj, down_proj = fold.exact(fix, (attn_out, mlp_out))
    scaled = lambda x, p: None if x is None else x * p.scale  # noqa: E731
    w_o, b_o = scaled(o_proj.weight, attn_out), scaled(o_proj.bias, attn_out)
    w_down, b_down = scaled(down_proj.weight, mlp_out), scaled(down_proj.bias, mlp_out)
    dtype = np.result_type(attn_out.weight, mlp_out.weight)
    w_out = np.concatenate([w_o, w_down], axis=0).astype(dtype)
    b_out = sum((b for b in (b_o, b_down) if b is not None), np.zeros(w_out.shape[1])).astype(dtype)
    return e.op("MatMul", [hidden, const("w_out", w_out)], "out_proj"), b_out if np.any(b_out) else None


def _nbits_out(e: Emitter, const, hidden: ir.Value, attn_out: projection.Projection, mlp_out: projection.Projection, fix: Fix
               ) -> tuple[ir.Value, np.ndarray | None]:
    """hidden @ [W_o ; W_down] as one MatMulNBits along K, its blocks concatenated (the fix's codes where one is
    folded in, else each node's own), and the summed bias (None where it is 0); a residual multiplier goes into the
    scales."""
    o_proj, down_proj = fold.folded(fix, (attn_out, mlp_out))  # codes on each node's own scales
    qo, qd = attn_out.quant, mlp_out.quant
    scales = np.concatenate([qo.scales * attn_out.scale, qd.scales * mlp_out.scale], axis=1).astype(qo.dtype)
    inputs: list[ir.Value | None] = [
        hidden,
        const("w_out", np.concatenate([o_proj.weight, down_proj.weight], axis=1)),
        const("w_out_scales", nbits.stored_scales(attn_out.node, scales)),
    ]
    if any(nbits.optional(p.node, nbits.ZERO_POINTS) is not None for p in (attn_out, mlp_out)):
        zeros = np.concatenate([qo.zeros, qd.zeros], axis=1)
        inputs.append(const("w_out_zero_points", nbits.pack(zeros, qo.bits).reshape(-1)))
    one = nodes.copy(attn_out.node, inputs, e.name("out_proj"))
    one.attributes["K"] = ir.AttrInt64("K", qo.k + qd.k)
    e.nodes.append(one)
    b_out = sum((s.bias.astype(np.float64) * s.projection.scale for s in (o_proj, down_proj) if s.bias is not None), np.zeros(qo.n))
    return one.outputs[0], b_out.astype(qo.dtype) if np.any(b_out) else None


def _concatenated(g: ir.Graph, readers: list[ir.Node], source: ir.Value, name: str) -> ir.Node:
    """One MatMulNBits reading `source` whose N is the readers' Ns in order: codes, scales, zero points (unpacked,
    concatenated, packed again per row) and biases concatenated along N."""
    quants = [nbits.read(u) for u in readers]
    first = quants[0]
    inputs: list[ir.Value | None] = [source, nodes.initializer(g, f"{name}/weight", np.concatenate([nbits.array(u, nbits.B) for u in readers], axis=0))]
    scales = np.concatenate([q.scales for q in quants], axis=0).astype(first.dtype)
    inputs.append(nodes.initializer(g, f"{name}/scales", nbits.stored_scales(readers[0], scales)))
    zero_points = any(nbits.optional(u, nbits.ZERO_POINTS) is not None for u in readers)
    biases = [nbits.array(u, nbits.BIAS) for u in readers]
    inputs.append(nodes.initializer(g, f"{name}/zero_points", nbits.pack(np.concatenate([q.zeros for q in quants], axis=0), first.bits).reshape(-1))
                  if zero_points else None)
    if any(b is not None for b in biases):
        inputs += [None, nodes.initializer(g, f"{name}/bias", np.concatenate(
            [np.zeros(q.n, first.dtype) if b is None else b for b, q in zip(biases, quants)]).astype(first.dtype))]
    while inputs[-1] is None:
        inputs.pop()
    one = nodes.copy(readers[0], inputs, name)
    one.attributes["N"] = ir.AttrInt64("N", sum(q.n for q in quants))
    return one


def _normalize(op, const, x, ln, d_model: int, np_dtype):
    """normalize(x) without scale or bias: LayerNormalization with ones / zeros, or x / rms(x)."""
    axes = const("axes", np.array([-1], dtype=np.int64))
    if ln.kind == "LayerNorm":
        ones, zeros = const("ones", np.ones(d_model, np_dtype)), const("zeros", np.zeros(d_model, np_dtype))
        return op("LayerNormalization", [x, ones, zeros], "norm", axis=-1, epsilon=ln.eps)  # statistics in float32 (stash_type)
    narrow = narrower_than_float32(np_dtype)  # x**2 over d_model overflows float16: float32 between Casts, as the exporter's RMSNorm
    wide = op("Cast", [x], "resid_pre_float", to=ir.DataType.FLOAT) if narrow else x
    square = op("Mul", [wide, wide], "square")
    mean = op("ReduceMean", [square, axes], "mean_square", keepdims=1)
    eps = np.array(ln.eps, np.float32 if narrow else np_dtype)
    rms = op("Sqrt", [op("Add", [mean, const("eps", eps)], "plus_eps")], "rms")
    n = op("Div", [wide, rms], "norm")
    return op("Cast", [n], "norm_" + np_dtype.name, to=ir.DataType.from_numpy(np_dtype)) if narrow else n

