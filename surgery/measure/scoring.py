"""The scoring graph and its session: a model's next-token NLL, top-1 and (against a first model's log-probs) KL per
token, computed inside ONNX Runtime so one number per token leaves the session; perplexity() and compare() of models
on windows -> statistics.Perplexity. Never prints."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery.engine import runtime
from surgery.engine.progress import Step
from surgery.errors import SurgeryError
from surgery.files import graph, ops
from surgery.measure.statistics import Perplexity, from_sums, joined
from surgery.text.data import Windows

TARGETS, NLL = "surgery_targets", "surgery_nll"
LOGPROBS, TOP1 = "surgery_logprobs", "surgery_top1"  # every scoring graph's next-token distribution and its argmax
REFERENCE, KL = "surgery_reference", "surgery_kl"  # a comparing graph's input (the first model's log-probs) and KL_t
POSITIONS = "surgery_positions"  # a selecting graph's input: the flat positions it scores
BLOCK = 256  # vocabulary entries whose exponentials are summed first (_log_softmax)




@dataclasses.dataclass(frozen=True)
class Reference:
    """The first model's next-token distribution on one batch of windows: what KL and top-1 agreement compare with."""

    logprobs: np.ndarray  # [batch, seq, vocab] float32, log softmax of the logits
    top1: np.ndarray  # [batch, seq] int64, argmax



def scoring_model(model: ir.Model, keep: Sequence[str] = (), compare: bool = False, select: bool = False, float_sum: bool = False) -> ir.Model:
    """A copy of `model` that takes `surgery_targets` [batch, seq] and outputs `surgery_nll` [batch, seq]: -log softmax(logits)[target], so one number per token
    leaves the session; then `surgery_logprobs` [batch, seq, vocab] (fetched only for a reference) and `surgery_top1` [batch, seq]; then the outputs named in
    `keep`. compare: also take `surgery_reference` [batch, seq, vocab] (the first model's log-probs) and output `surgery_kl` [batch, seq] = sum_v exp(ref)
    (ref - logprobs), so the vocabulary never leaves the session. select: also take `surgery_positions` [n], flat indices
    (row * seq + position) of the positions scored: the vocabulary projection runs on those only (_select), and targets
    and the per-token outputs are [1, n]. float_sum: ONNX Runtime's LogSoftmax, as torch's float32 one computes it (lm-eval's
    `hf` backend), instead of the exact blocked sum (_log_softmax)."""
    model = model.clone()
    g = model.graph
    logits = next((v for v in g.outputs if v.name == "logits"), None)
    if logits is None:
        names = ", ".join(v.name for v in g.outputs)
        raise SurgeryError(f"the graph has no `logits` output (it has {names}); evaluate needs a causal LM from `surgery export`")
    per_token = ir.Shape([1, "positions"] if select else ["batch_size", "sequence_length"])
    targets = ir.Value(name=TARGETS, type=ir.TensorType(ir.DataType.INT64), shape=per_token)
    axis = _constant(g, "last_axis", np.array([-1], np.int64))
    vocab = logits.shape[-1] if logits.shape is not None else None
    scores = logits
    if select:
        g.inputs.append(ir.Value(name=POSITIONS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["positions"])))
        scores = _select(g, logits, g.inputs[-1])
    nodes = []
    if logits.dtype not in (None, ir.DataType.FLOAT):
        nodes.append(ir.node("Cast", [scores], attributes={"to": ir.DataType.FLOAT}))
        scores = nodes[-1].outputs[0]
    if float_sum:
        nodes.append(ir.node("LogSoftmax", [scores], attributes={"axis": -1}))
        logprobs = nodes[-1].outputs[0]
    else:
        logprobs = _log_softmax(g, nodes, scores, vocab, axis)
    nodes.append(ir.node("Unsqueeze", [targets, axis]))
    nodes.append(ir.node("GatherElements", [logprobs, nodes[-1].outputs[0]], attributes={"axis": -1}))
    nodes.append(ir.node("Squeeze", [nodes[-1].outputs[0], axis]))
    nodes.append(ir.node("Neg", [nodes[-1].outputs[0]]))
    nll = nodes[-1].outputs[0]
    nodes.append(ir.node("ArgMax", [logprobs], attributes={"axis": -1, "keepdims": 0}))
    top1 = nodes[-1].outputs[0]
    outputs = [(nll, NLL, ir.DataType.FLOAT, per_token), (logprobs, LOGPROBS, ir.DataType.FLOAT, ir.Shape([*per_token, "vocab"])),
               (top1, TOP1, ir.DataType.INT64, per_token)]
    if compare:
        reference = ir.Value(name=REFERENCE, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([*per_token, "vocab"]))
        g.inputs.append(reference)
        nodes.append(ir.node("Sub", [reference, logprobs]))
        nodes.append(ir.node("Exp", [reference]))
        nodes.append(ir.node("Mul", [nodes[-1].outputs[0], nodes[-2].outputs[0]]))
        nodes.append(ir.node("ReduceSum", [nodes[-1].outputs[0], axis], attributes={"keepdims": 0}))
        outputs.append((nodes[-1].outputs[0], KL, ir.DataType.FLOAT, per_token))
    for i, node in enumerate(nodes):
        node.name = node.outputs[0].name = f"surgery/evaluate/{i}_{node.op_type}"
    for value, name, dtype, shape in outputs:
        value.name, value.dtype, value.shape = name, dtype, shape
    g.extend(nodes)
    g.inputs.append(targets)
    kept = [v for name in keep for v in g.outputs if v.name == name]
    g.outputs.clear()
    g.outputs.extend([v for v, *_ in outputs] + kept)
    RemoveUnusedNodesPass()(model)  # drops the KV cache outputs' own nodes
    return model


def _select(g: ir.Graph, logits: ir.Value, positions: ir.Value) -> ir.Value:
    """The rows `positions` of the logits as [batch * seq, vocab], as [1, n, vocab]: the vocabulary projection that makes
    them (through Casts) reads those rows of its hidden states only (`logits` itself is then that value), or, where it
    reads no [batch, seq, hidden] tensor, the logits are gathered."""
    node, chain = logits.producer(), [logits]
    while node is not None and node.op_type in ("Cast", "Identity"):
        chain.append(node.inputs[0])
        node = node.inputs[0].producer()
    rank = len(logits.shape) if logits.shape is not None else None  # a projection keeps its input's rank (Gemm's: 2)
    head = node is not None and node.op_type in ops.PROJECTIONS and node.op_type != "Gemm" and rank == 3
    source = node.inputs[0] if head else logits
    flat = ir.node("Flatten", [source], attributes={"axis": 2})
    picked = ir.node("Gather", [flat.outputs[0], positions], attributes={"axis": 0})
    zero = _constant(g, "first_axis", np.array([0], np.int64))
    one_row = ir.node("Unsqueeze", [picked.outputs[0], zero])
    added = [flat, picked, one_row]
    for i, new in enumerate(added):
        new.name = new.outputs[0].name = f"surgery/select/{i}_{new.op_type}"
    if not head:
        g.insert_after(logits.producer(), added)
        return one_row.outputs[0]
    g.insert_before(node, added)
    node.replace_input_with(0, one_row.outputs[0])
    for value in chain:
        value.shape = None
    return logits


def _log_softmax(g: ir.Graph, nodes: list[ir.Node], scores: ir.Value, vocab, axis: ir.Value) -> ir.Value:
    """log softmax over the vocabulary, its sum of exponentials taken in blocks of BLOCK (or in float64 where the
    vocabulary's size is not declared): ONNX Runtime's float LogSoftmax adds 49152 terms in one float accumulator and
    on SmolLM2's logits gives log-probabilities 1.8e-5 too high on average (a bias, not noise, which torch's float32
    log_softmax shares and NumPy's pairwise sum has not), 1e-3 nats summed over a 60-token continuation. Appends to
    `nodes`."""
    top = ir.node("ReduceMax", [scores, axis], attributes={"keepdims": 1})
    shifted = ir.node("Sub", [scores, top.outputs[0]])
    exp = ir.node("Exp", [shifted.outputs[0]])
    nodes += [top, shifted, exp]
    terms = exp.outputs[0]
    if isinstance(vocab, int):
        if vocab % BLOCK:
            pads = _constant(g, "pads", np.array([0, 0, 0, 0, 0, BLOCK - vocab % BLOCK], np.int64))
            nodes.append(ir.node("Pad", [terms, pads]))  # zeros: nothing added to the sum
            terms = nodes[-1].outputs[0]
        nodes.append(ir.node("Reshape", [terms, _constant(g, "blocks", np.array([0, 0, -1, BLOCK], np.int64))]))
        nodes.append(ir.node("ReduceSum", [nodes[-1].outputs[0], axis], attributes={"keepdims": 0}))
        nodes.append(ir.node("ReduceSum", [nodes[-1].outputs[0], axis], attributes={"keepdims": 1}))
        nodes.append(ir.node("Log", [nodes[-1].outputs[0]]))
    else:
        nodes.append(ir.node("Cast", [terms], attributes={"to": ir.DataType.DOUBLE}))
        nodes.append(ir.node("ReduceSum", [nodes[-1].outputs[0], axis], attributes={"keepdims": 1}))
        nodes.append(ir.node("Log", [nodes[-1].outputs[0]]))
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": ir.DataType.FLOAT}))
    nodes.append(ir.node("Sub", [shifted.outputs[0], nodes[-1].outputs[0]]))
    return nodes[-1].outputs[0]


def _constant(g: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=f"surgery/evaluate/{name}", const_value=ir.tensor(array, name=f"surgery/evaluate/{name}"))
    g.register_initializer(value)
    return value


class Scorer:
    """One session that scores token windows under a model; reuse it for many windows or switch settings. keep: outputs of `model` that a call can also hand
    back (see `kept`). compare: the session also takes the first model's log-probs, for KL and top-1 agreement (see `reference`)."""

    def __init__(
        self, model: ir.Model | str | Path, options: runtime.Options = runtime.Options(), keep: Sequence[str] = (), compare: bool = False
    ):
        if not isinstance(model, ir.Model):
            model = graph.load(model)
        self.keep, self.compare = tuple(keep), compare
        self.session = runtime.session(scoring_model(model, self.keep, compare), options)

    def __call__(
        self,
        windows: Windows,
        *,
        batch_size: int = 1,
        extra: dict[str, np.ndarray] | None = None,
        progress: Step | None = None,
        kept: dict[str, np.ndarray] | None = None,
        reference: Sequence[Reference] | None = None,
        record: list[Reference] | None = None,
    ) -> Perplexity:
        """Token-weighted mean NLL (nats) of `windows`; `extra` feeds inputs a diagnostic graph added. `kept`, when given, receives the `keep` outputs of the
        last batch, by name. reference: one Reference per batch (of `batch_size` windows), the first model's on the same windows: the result then also holds KL
        and top-1 agreement. record: receives this model's Reference of each batch."""
        if reference is not None and not self.compare:
            raise SurgeryError("a Scorer compares with a reference only when built with compare=True")
        start = time.perf_counter()
        sums, counts, kl_sums, agree, token_kl, token_nll = [], [], [], [], [], []
        positions = np.arange(windows.seq_len)
        for batch, lo in enumerate(range(0, len(windows), batch_size)):
            ids = windows.ids[lo : lo + batch_size]
            targets = np.zeros_like(ids)
            targets[:, :-1] = ids[:, 1:]  # position t predicts token t + 1; the last position predicts nothing
            ref = None if reference is None else reference[batch]
            compared = {}
            if self.compare:  # without a reference, a [batch, seq, 1] stand-in that broadcasts (its KL is not fetched)
                compared[REFERENCE] = ref.logprobs if ref else np.zeros((*ids.shape, 1), np.float32)
            feed = runtime.feeds(self.session, ids, extra={TARGETS: targets, **(extra or {}), **compared})
            names = [NLL, TOP1, *([KL] if ref else []), *([LOGPROBS] if record is not None else []), *(self.keep if kept is not None else ())]
            out = dict(zip(names, self.session.run(names, feed)))
            if kept is not None:
                kept.update({name: out[name] for name in self.keep})
            if record is not None:
                record.append(Reference(out[LOGPROBS], out[TOP1]))
            first = windows.score_from[lo : lo + batch_size, None]
            scored = (positions[None, :] >= first) & (positions[None, :] < windows.seq_len - 1)
            sums += [float(s) for s in np.where(scored, out[NLL], 0).astype(np.float64).sum(1)]
            counts += [int(c) for c in scored.sum(1)]
            token_nll += [float(x) for x in out[NLL][scored]]
            if ref is not None:
                kl_sums += [float(s) for s in np.where(scored, out[KL], 0).astype(np.float64).sum(1)]
                agree += [int(a) for a in (scored & (out[TOP1] == ref.top1)).sum(1)]
                token_kl += [float(k) for k in out[KL][scored]]
            if progress:
                progress(len(ids))
        return from_sums(sums, counts, windows.sampled, len(windows), time.perf_counter() - start,
                         window_kl=kl_sums, window_top1=agree, token_kl=token_kl, token_nll=token_nll)


def perplexity(
    model: ir.Model | str | Path,
    windows: Windows,
    *,
    batch_size: int = 1,
    options: runtime.Options = runtime.Options(),
    progress: Step | None = None,
) -> Perplexity:
    """Token-weighted mean NLL (nats) of `windows` under `model`, computed by ONNX Runtime."""
    return Scorer(model, options)(windows, batch_size=batch_size, progress=progress)


def compare(
    models: Sequence[ir.Model | str | Path],
    windows: Windows,
    *,
    batch_size: int = 1,
    options: runtime.Options = runtime.Options(),
    progress: Callable[[int, int], None] | None = None,
) -> list[Perplexity]:
    """The Perplexity of each model on `windows`, every model after the first also scored against the first's
    next-token distribution (KL, top-1 agreement: see `divergence`). One forward pass per model and batch;
    batch by batch, so only one batch's log-probs are held at a time. progress(model index, windows done)."""
    scorers = [Scorer(m, options, compare=i > 0) for i, m in enumerate(models)]
    parts: list[list[Perplexity]] = [[] for _ in models]
    for lo in range(0, len(windows), batch_size):
        batch = windows.take(range(lo, min(lo + batch_size, len(windows))))
        reference: list[Reference] = []
        for i, scorer in enumerate(scorers):
            parts[i].append(scorer(batch, batch_size=batch_size, record=reference if i == 0 else None, reference=reference if i else None))
            if progress:
                progress(i, len(batch))
    return [joined(p) for p in parts]
