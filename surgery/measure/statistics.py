"""Loss, dNLL and KL of scored windows, with their intervals: Perplexity, Delta, Divergence (scoring.py makes the
Perplexity of a model on windows; timing.py the latency). Numbers only: report/ formats them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from surgery.errors import SurgeryError
from surgery.files.checkpoint import checkpointable
from surgery.measure import quality


@checkpointable
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
    return from_sums(concat("window_nll"), concat("window_tokens"), sampled, sum(p.windows for p in parts), sum(p.seconds for p in parts),
                   **{field: concat(field) for field in AGAINST})


def _text(sampled: Sequence[bool]) -> np.ndarray:
    """Indices of the text windows among `sampled`, or of all of them when every one is a sample."""
    sampled = np.asarray(sampled, bool)
    return np.flatnonzero(~sampled) if not sampled.all() else np.arange(len(sampled))


AGAINST = ("window_kl", "window_top1", "token_kl", "token_nll")  # Perplexity's fields measured against a Reference


def from_sums(sums, counts, sampled, windows, seconds, **against) -> Perplexity:
    """The Perplexity of per-window sums: the loss of the text windows (_text); `against`: the AGAINST fields, as tuples."""
    sampled = tuple(bool(x) for x in sampled)
    text = _text(sampled)
    loss = float(sum(sums[i] for i in text) / max(sum(counts[i] for i in text), 1))
    return Perplexity(loss=loss, perplexity=math.exp(loss), tokens=sum(counts), windows=windows, seconds=seconds, window_nll=tuple(sums),
                      window_tokens=tuple(counts), window_sampled=sampled, **{k: tuple(v) for k, v in against.items()})


@checkpointable
@dataclasses.dataclass(frozen=True)
class Delta:
    """dNLL = loss(other) - loss(base) on the same windows, with a 95 % paired bootstrap interval over windows."""

    dnll: float
    low: float
    high: float

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


@checkpointable
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

    def to_json(self) -> dict:
        out = {"kl": self.kl, "kl_interval": [self.low, self.high], "kl_p99": self.p99, "top1_agreement": self.top1}
        return out | ({"llama_cpp": self.llama_cpp.to_json()} if self.llama_cpp else {})


def divergence(score: Perplexity, base: Perplexity | None = None, *, resamples: int = 2000, seed: int = 0) -> Divergence:
    """The Divergence of a model scored against a Reference (scoring.Scorer with compare=True); with the first model's
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
