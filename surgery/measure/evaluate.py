"""perplexity(), KL and dNLL of ONNX graphs on ONNX Runtime -> dataclasses (latency: timing.py). Never prints."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.measure import quality, runtime
from surgery.measure.data import DataSettings, Windows
from surgery.measure.progress import Step, Tell, counter, silent
from surgery.measure.timing import Latency, LatencySettings, check_seq_len, latency

TARGETS, NLL = "surgery_targets", "surgery_nll"
LOGPROBS, TOP1 = "surgery_logprobs", "surgery_top1"  # every scoring graph's next-token distribution and its argmax
REFERENCE, KL = "surgery_reference", "surgery_kl"  # a comparing graph's input (the first model's log-probs) and KL_t


@dataclasses.dataclass(frozen=True)
class Reference:
    """The first model's next-token distribution on one batch of windows: what KL and top-1 agreement compare with."""

    logprobs: np.ndarray  # [batch, seq, vocab] float32, log softmax of the logits
    top1: np.ndarray  # [batch, seq] int64, argmax


@dataclasses.dataclass(frozen=True)
class Perplexity:
    """One model's token-weighted mean NLL (loss, nats) on some windows, with per-window and per-token sums (for `delta`, `divergence`).

    The model's own samples among the windows (Windows.sampled, the default corpus's half) count in KL and top-1, not in
    the loss, perplexity or dNLL: on text a model wrote itself a change's expected dNLL is its KL, not a loss on text.
    When every window is a sample they all count."""
    loss: float  # token-weighted mean NLL of the text windows, nats
    perplexity: float
    tokens: int
    windows: int
    seconds: float
    window_nll: tuple[float, ...] = ()  # summed NLL of each window's scored targets, for paired intervals
    window_tokens: tuple[int, ...] = ()
    # Against a Reference (empty without one): summed KL(reference || this) and top-1 agreements of each
    # window's scored positions, and every scored position's KL_t (for percentiles).
    window_kl: tuple[float, ...] = ()
    window_top1: tuple[int, ...] = ()
    token_kl: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    token_nll: tuple[float, ...] = dataclasses.field(default=(), repr=False)  # every scored position's NLL_t, in token_kl's order
    window_sampled: tuple[bool, ...] = ()  # which windows are the model's own samples (none when empty)

    def sampled(self) -> tuple[bool, ...]:
        """Per window, whether it is one of the model's own samples (all False when none was recorded)."""
        return self.window_sampled or (False,) * len(self.window_nll)

    def text(self) -> np.ndarray:
        """Indices of the windows the loss and dNLL count (_text)."""
        return _text(self.sampled())

    def summary(self) -> dict:
        """The numbers without the per-window and per-token tuples."""
        return {k: getattr(self, k) for k in ("loss", "perplexity", "tokens", "windows", "seconds")}


def joined(parts: Sequence[Perplexity]) -> Perplexity:
    """The Perplexity of all the windows of `parts`, in order, each part scored on its own windows."""
    concat = lambda field: tuple(x for p in parts for x in getattr(p, field))  # noqa: E731
    sampled = tuple(x for p in parts for x in p.sampled())
    return _scored(concat("window_nll"), concat("window_tokens"), sampled, sum(p.windows for p in parts), sum(p.seconds for p in parts),
                   **{field: concat(field) for field in AGAINST})


def _text(sampled: Sequence[bool]) -> np.ndarray:
    """Indices of the text windows among `sampled`, or of all of them when every one is a sample."""
    sampled = np.asarray(sampled, bool)
    return np.flatnonzero(~sampled) if not sampled.all() else np.arange(len(sampled))


AGAINST = ("window_kl", "window_top1", "token_kl", "token_nll")  # Perplexity's fields measured against a Reference


def _scored(sums, counts, sampled, windows, seconds, **against) -> Perplexity:
    """The Perplexity of per-window sums: the loss of the text windows (_text); `against`: the AGAINST fields, as tuples."""
    sampled = tuple(bool(x) for x in sampled)
    text = _text(sampled)
    loss = float(sum(sums[i] for i in text) / max(sum(counts[i] for i in text), 1))
    return Perplexity(loss=loss, perplexity=math.exp(loss), tokens=sum(counts), windows=windows, seconds=seconds, window_nll=tuple(sums),
                      window_tokens=tuple(counts), window_sampled=sampled, **{k: tuple(v) for k, v in against.items()})


@dataclasses.dataclass(frozen=True)
class Delta:
    """dNLL = loss(other) - loss(base) on the same windows, with a 95 % paired bootstrap interval over windows."""

    dnll: float
    low: float
    high: float

    def __str__(self) -> str:
        return with_interval(self.dnll, (self.low, self.high))

    def to_json(self) -> dict:
        return {"dnll": self.dnll, "low": self.low, "high": self.high}


def delta(base: Perplexity, other: Perplexity, *, resamples: int = 2000, seed: int = 0) -> Delta:
    """Paired bootstrap of dNLL over windows: resample windows with replacement, the same ones for both
    models, and take the 2.5 / 97.5 percentiles of the token-weighted difference.

    Raises:
        SurgeryError: `base` and `other` were not scored on the same windows (their window_tokens differ).
    """
    if base.window_tokens != other.window_tokens:
        raise SurgeryError("dNLL needs both models scored on the same windows")
    text = base.text()  # the text windows (Perplexity's docstring)
    diff = np.asarray(other.window_nll, np.float64)[text] - np.asarray(base.window_nll, np.float64)[text]
    return Delta(*_bootstrap(diff, tuple(np.asarray(base.window_tokens)[text]), resamples, seed))


@dataclasses.dataclass(frozen=True)
class Divergence:
    """How far a model's next-token distribution moved from the first model's, over scored positions t: mean KL_t = sum_v p_first(v) (log p_first(v) -
    log p_this(v)) in nats, with a 95 % bootstrap interval over windows, the 99th percentile of KL_t, and top-1 agreement (argmax p_first = argmax p_this)."""

    kl: float
    low: float
    high: float
    p99: float
    top1: float  # fraction of scored positions
    llama_cpp: quality.Quality | None = None  # llama.cpp's statistics, when scored with the first model's per-token NLL

    def __str__(self) -> str:
        return f"{self.kl:.4f} [{self.low:.4f}, {self.high:.4f}]"

    def to_json(self) -> dict:
        out = {"kl": self.kl, "kl_interval": [self.low, self.high], "kl_p99": self.p99, "top1_agreement": self.top1}
        return out | ({"llama_cpp": self.llama_cpp.to_json()} if self.llama_cpp else {})


def divergence(score: Perplexity, base: Perplexity | None = None, *, resamples: int = 2000, seed: int = 0) -> Divergence:
    """The Divergence of a model scored against a Reference (Scorer with compare=True); with the first model's
    score `base` on the same windows (with its per-token NLL), also llama.cpp's statistics (quality.of).

    Raises:
        SurgeryError: `score` was not scored against a reference (it is `compare`'s first model, or from `perplexity`).
    """
    if not score.window_kl:
        raise SurgeryError("KL needs the model scored against the first model's log-probs (Scorer(compare=True))")
    kl, low, high = _bootstrap(np.asarray(score.window_kl, np.float64), score.window_tokens, resamples, seed)
    p99 = float(np.percentile(np.asarray(score.token_kl, np.float64), 99))
    same = quality.of(base.token_nll, score.token_nll, score.token_kl, sum(score.window_top1)) if base and base.token_nll else None
    return Divergence(kl=kl, low=low, high=high, p99=p99, top1=sum(score.window_top1) / sum(score.window_tokens), llama_cpp=same)


def _bootstrap(sums: np.ndarray, tokens: Sequence[int], resamples: int, seed: int) -> tuple[float, float, float]:
    """sum(sums) / sum(tokens) and the 2.5 / 97.5 percentiles of the same ratio over windows resampled with replacement."""
    tokens = np.asarray(tokens, np.float64)
    point = float(sums.sum() / tokens.sum())
    if len(sums) < 2:
        return point, point, point
    picks = np.random.default_rng(seed).integers(0, len(sums), size=(resamples, len(sums)))
    low, high = np.percentile(sums[picks].sum(1) / tokens[picks].sum(1), [2.5, 97.5])
    return point, float(low), float(high)


def scoring_model(model: ir.Model, keep: Sequence[str] = (), compare: bool = False) -> ir.Model:
    """A copy of `model` that takes `surgery_targets` [batch, seq] and outputs `surgery_nll` [batch, seq]: -log softmax(logits)[target], so one number per token
    leaves the session; then `surgery_logprobs` [batch, seq, vocab] (fetched only for a reference) and `surgery_top1` [batch, seq]; then the outputs named in
    `keep`. compare: also take `surgery_reference` [batch, seq, vocab] (the first model's log-probs) and output `surgery_kl` [batch, seq] = sum_v exp(ref)
    (ref - logprobs), so the vocabulary never leaves the session."""
    model = model.clone()
    g = model.graph
    logits = next((v for v in g.outputs if v.name == "logits"), None)
    if logits is None:
        names = ", ".join(v.name for v in g.outputs)
        raise SurgeryError(f"the graph has no `logits` output (it has {names}); evaluate needs a causal LM from `surgery export`")
    targets = ir.Value(name=TARGETS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch_size", "sequence_length"]))
    axis = ir.Value(name="surgery/evaluate/last_axis", const_value=ir.tensor(np.array([-1], np.int64), name="surgery/evaluate/last_axis"))
    g.register_initializer(axis)
    scores = logits
    nodes = []
    if logits.dtype not in (None, ir.DataType.FLOAT):
        nodes.append(ir.node("Cast", [logits], attributes={"to": ir.DataType.FLOAT}))
        scores = nodes[-1].outputs[0]
    nodes.append(ir.node("LogSoftmax", [scores], attributes={"axis": -1}))
    logprobs = nodes[-1].outputs[0]
    nodes.append(ir.node("Unsqueeze", [targets, axis]))
    nodes.append(ir.node("GatherElements", [logprobs, nodes[-1].outputs[0]], attributes={"axis": -1}))
    nodes.append(ir.node("Squeeze", [nodes[-1].outputs[0], axis]))
    nodes.append(ir.node("Neg", [nodes[-1].outputs[0]]))
    nll = nodes[-1].outputs[0]
    nodes.append(ir.node("ArgMax", [logprobs], attributes={"axis": -1, "keepdims": 0}))
    top1 = nodes[-1].outputs[0]
    per_token = ir.Shape(["batch_size", "sequence_length"])
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
        return _scored(sums, counts, windows.sampled, len(windows), time.perf_counter() - start,
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


def side_by_side(models: Sequence, names: Sequence[str], data: DataSettings, max_windows: int | None = None, part: str = "evaluation",
                 batch_size: int = 1, timed: LatencySettings = LatencySettings(), options: runtime.Options = runtime.Options(),
                 progress: Tell | None = None) -> tuple[Windows, list[dict]]:
    """What `surgery evaluate` measures: the models scored on `max_windows` windows of the corpus's `part` (`compare`), then their
    latency with the repeats interleaved (when `timed.measure`); the windows and one row per model (`rows`). progress(stage, done,
    total), one stage per model's perplexity and one for the latency."""
    tell = progress or silent
    for model in models:
        graph.resolve(model)  # every path checked before minutes of work
    check_seq_len(models[0], data.seq_len, decode=timed.measure)
    windows = data.windows(models[0], max_windows, part, tell)
    scored = [counter(tell, f"perplexity {name}", len(windows)) for name in names]
    scores = compare(models, windows, batch_size=batch_size, options=options, progress=lambda i, n: scored[i](n))
    timings = []
    if timed.measure:
        timings = latency(models, batch=timed.batch, seq_len=data.seq_len, repeats=timed.repeats, warmup=timed.warmup, options=options,
                          progress=counter(tell, "latency (interleaved)", timed.repeats))
    return windows, rows(models, names, scores, timings)


def rows(models: Sequence, names: Sequence[str], scores: Sequence[Perplexity], timings: Sequence[Latency] = ()) -> list[dict]:
    """What `surgery evaluate` prints per model, from `compare` (and `latency`): loss, dNLL vs the first with its
    interval, KL / its interval / p99 / top-1 agreement / llama.cpp's statistics vs the first (None for the first), latency and ratios."""
    out = []
    for i, (model, name, score) in enumerate(zip(models, names, scores)):
        d = None if i == 0 else delta(scores[0], score)
        row = {"model": str(model), "name": name, **score.summary(), "dnll": score.loss - scores[0].loss,
               "dnll_interval": None if d is None else [d.low, d.high]}
        row |= divergence(score, scores[0]).to_json() if i else dict.fromkeys(("kl", "kl_interval", "kl_p99", "top1_agreement", "llama_cpp"))
        if timings:
            t, t0 = timings[i], timings[0]
            row.update(dataclasses.asdict(t))
            row["placement"] = str(t.placement) if t.placement else runtime.short_name(t.provider)
            row["on_cpu"] = dict(t.placement.on_cpu) if t.placement else None
            row["prefill_ratio"] = t0.prefill_ms / t.prefill_ms
            row["decode_ratio"] = t0.decode_ms / t.decode_ms if t.decode_ms and t0.decode_ms else None
        out.append(row)
    return out


def _or_dash(key: str, cell: Callable[[dict], str]) -> Callable[[dict], str]:
    """A cell that reads row[key]: `-` where the row has none (the first model's KL, a graph without decode, ...)."""
    return lambda row: "-" if row.get(key) is None else cell(row)


# `surgery evaluate`'s table: (header, the cell of one `rows` row, which rows' table shows it: "score", or "latency" when timed).
# A new statistic is a field of its result (Perplexity / Divergence / Latency), its key in `rows`, and a line here.
COLUMNS: tuple[tuple[str, Callable[[dict], str], str], ...] = (
    ("model", lambda r: r["name"], "score"),
    ("loss", lambda r: f"{r['loss']:.4f}", "score"),
    ("ppl", lambda r: f"{r['perplexity']:.3f}", "score"),
    ("dNLL", lambda r: f"{r['dnll']:+.4f}", "score"),
    ("95 % CI", _or_dash("dnll_interval", lambda r: interval(r["dnll_interval"])), "score"),
    ("KL", _or_dash("kl", lambda r: f"{r['kl']:.4f}"), "score"),
    ("95 % CI ", _or_dash("kl", lambda r: f"[{r['kl_interval'][0]:.4f}, {r['kl_interval'][1]:.4f}]"), "score"),
    ("KL p99", _or_dash("kl", lambda r: f"{r['kl_p99']:.4f}"), "score"),
    ("top-1", _or_dash("kl", lambda r: f"{100 * r['top1_agreement']:.1f} %"), "score"),
    ("Same top p", _or_dash("llama_cpp", lambda r: pm(r["llama_cpp"], "Same top p")), "score"),
    ("99.9% KLD", _or_dash("llama_cpp", lambda r: f"{r['llama_cpp']['99.9% KLD']:.4f}"), "score"),
    ("RMS Δp", _or_dash("llama_cpp", lambda r: pm(r["llama_cpp"], "RMS Δp")), "score"),
    ("provider", lambda r: r["placement"], "latency"),  # where ORT ran the nodes: CUDA, or CUDA (CPU: the ops it left on the host)
    ("prefill ms", lambda r: f"{r['prefill_ms']:.2f}", "latency"),
    ("decode ms/tok", _or_dash("decode_ms", lambda r: f"{r['decode_ms']:.2f}"), "latency"),
    ("prefill x", lambda r: f"{r['prefill_ratio']:.3f}", "latency"),
    ("decode x", _or_dash("decode_ratio", lambda r: f"{r['decode_ratio']:.3f}"), "latency"),
)


def columns(timed: bool) -> list[tuple[str, Callable[[dict], str]]]:
    """The columns of `surgery evaluate`'s table: the scores', and the latency's when it was timed."""
    return [(header, cell) for header, cell, shown in COLUMNS if shown == "score" or timed]


def pm(stats: dict, label: str) -> str:
    """llama.cpp's `x ± u %` of one of its statistics."""
    return f"{stats[label]:.3f} ± {stats[label + ' uncertainty']:.3f} %"


def interval(bounds) -> str:
    """A dNLL's interval: "[+0.0051, +0.0213]"."""
    return f"[{bounds[0]:+.4f}, {bounds[1]:+.4f}]"


def with_interval(value, bounds) -> str:
    """A dNLL beside its interval: "+0.0123 [+0.0051, +0.0213]" (the value alone without one)."""
    if value is None or bounds is None:
        return number(value)
    return f"{value:+.4f} {interval(bounds)}"


def number(value) -> str:
    """A report's value: `n/a` for None, 4 significant digits for a float, else as it prints."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
