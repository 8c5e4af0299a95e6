"""llama.cpp's quality statistics (`llama-perplexity --kl-divergence`) of a model against the original, from the
per-token values the scoring graphs return: NLL_t of both models, KL_t, and top-1 agreement. Never prints.

People who compare quantized or pruned models read llama.cpp's report; with its names and formulas
(tools/perplexity/perplexity.cpp, kl_divergence()) our numbers can stand next to their quantizations'.
p(target) = exp(-NLL_t), the probability a model gives the actual next token; Δp_t = p_new(target) - p_orig(target).
Mean ± uncertainty is llama.cpp's `mean_and_uncertainty`: the mean and sqrt((mean(x²) - mean(x)²) / (n - 1)), the
standard error (0 at 10 positions or fewer); percentiles interpolate linearly between sorted values at
fraction * (n - 1) (NumPy's default). Where llama.cpp scores the second half of each chunk, we score the
positions evaluate scores (Windows.score_from on).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from surgery.errors import SurgeryError
from surgery.files.checkpoint import checkpointable

# llama.cpp's percentile rows, top to bottom: its label and the fraction of sorted values below
KLD_ROWS = (("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9), ("Median", 0.5),
            ("10.0%", 0.1), ("5.0%", 0.05), ("1.0%", 0.01), ("0.1%", 0.001), ("Minimum", 0.0))
DP_ROWS = KLD_ROWS[:5] + (("75.0%", 0.75), ("Median", 0.5), ("25.0%", 0.25)) + KLD_ROWS[6:]


@checkpointable
@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean and its uncertainty (one standard error), as llama.cpp prints `value ± uncertainty`."""

    value: float
    uncertainty: float


def mean_and_uncertainty(values: np.ndarray) -> Estimate:
    """llama.cpp's mean_and_uncertainty(sum, sum2, count): the mean, and sqrt(variance / (n - 1)) with the
    population variance mean(x²) - mean(x)², 0 when that is not positive or n <= 10."""
    n = len(values)
    if n < 1:
        return Estimate(0.0, 0.0)
    mean = float(values.sum() / n)
    var = float((values * values).sum() / n - mean * mean)
    return Estimate(mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's covariance of two means: (mean(ab) - mean(a) mean(b)) / (n - 1); 0 under 10 positions."""
    n = len(a)
    return 0.0 if n < 10 else float(((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1))


def rms(values: np.ndarray) -> Estimate:
    """Root mean square with llama.cpp's uncertainty: that of mean(x²) through d sqrt(m) = dm / (2 sqrt(m))."""
    mse = mean_and_uncertainty(values * values)
    value = math.sqrt(mse.value)
    return Estimate(value, 0.5 / value * mse.uncertainty if value > 0 else 0.0)


def proportion(hits: int, n: int) -> Estimate:
    """A fraction with llama.cpp's binomial uncertainty sqrt(p (1 - p) / (n - 1))."""
    p = hits / n
    return Estimate(p, math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0)


def percentiles(values: np.ndarray, rows: Sequence[tuple[str, float]]) -> dict[str, float]:
    """llama.cpp's percentile rows of `values`: linear interpolation at fraction * (n - 1) of the sorted values."""
    return {label: float(np.percentile(values, 100 * fraction)) for label, fraction in rows}


@checkpointable
@dataclasses.dataclass(frozen=True)
class Quality:
    """llama.cpp's `--kl-divergence` report of a model (Q) against the original (base) over n scored positions.
    KLD in nats; Δp and Same top p as fractions here, in % in to_json (as llama.cpp prints them)."""

    n: int
    ln_ppl_ratio: Estimate  # Mean ln(PPL(Q)/PPL(base)): dNLL, with the uncertainty of a paired difference
    ppl: Estimate  # Mean PPL(Q) = exp(mean NLL) ± PPL * uncertainty of the mean NLL
    ppl_base: Estimate
    ppl_correlation: float  # Cor(ln(PPL(Q)), ln(PPL(base))): of the two mean NLLs
    mean_kld: Estimate
    kld: dict[str, float]  # KLD_ROWS: "Maximum", "99.9%", ... "Minimum"
    mean_dp: Estimate
    dp: dict[str, float]  # DP_ROWS
    rms_dp: Estimate
    same_top_p: Estimate  # fraction of positions whose argmax agrees

    def to_json(self) -> dict:
        """llama.cpp's report as one flat object, keyed by its labels (runs of spaces made one); a value printed
        `x ± u` is "label": x and "label uncertainty": u. Δp, RMS Δp and Same top p in %, as llama.cpp prints them."""
        out: dict[str, float | int] = {"count": self.n}

        def put(label: str, e: Estimate, scale: float = 1.0) -> None:
            out[label], out[f"{label} uncertainty"] = scale * e.value, scale * e.uncertainty

        put("Mean PPL(Q)", self.ppl)
        put("Mean PPL(base)", self.ppl_base)
        out["Cor(ln(PPL(Q)), ln(PPL(base)))"] = 100 * self.ppl_correlation
        put("Mean ln(PPL(Q)/PPL(base))", self.ln_ppl_ratio)
        put("Mean KLD", self.mean_kld)
        out |= {f"{label} KLD": v for label, v in self.kld.items()}
        put("Mean Δp", self.mean_dp, 100)
        out |= {f"{label} Δp": 100 * v for label, v in self.dp.items()}
        put("RMS Δp", self.rms_dp, 100)
        put("Same top p", self.same_top_p, 100)
        return out


def of(base_nll: Sequence[float], nll: Sequence[float], kl: Sequence[float], same_top: int) -> Quality:
    """llama.cpp's statistics from per-position values in one order: the original's and this model's NLL of the
    target (nats), KL_t(original || this), and the count of positions whose top-1 tokens agree."""
    base_nll, nll, kl = (np.asarray(x, np.float64) for x in (base_nll, nll, kl))
    n = len(nll)
    if n == 0 or len(base_nll) != n or len(kl) != n:
        raise SurgeryError(f"llama.cpp's statistics need the same scored positions for both models (NLL {len(base_nll)}, {n}; KL {len(kl)})")
    log_ppl, log_ppl_base = mean_and_uncertainty(nll), mean_and_uncertainty(base_nll)
    cov = covariance(nll, base_nll)
    spread = log_ppl.uncertainty * log_ppl_base.uncertainty
    ratio = math.sqrt(max(log_ppl.uncertainty**2 + log_ppl_base.uncertainty**2 - 2 * cov, 0.0))
    ppl, ppl_base = math.exp(log_ppl.value), math.exp(log_ppl_base.value)
    dp = np.exp(-nll) - np.exp(-base_nll)
    return Quality(
        n, Estimate(log_ppl.value - log_ppl_base.value, ratio), Estimate(ppl, ppl * log_ppl.uncertainty),
        Estimate(ppl_base, ppl_base * log_ppl_base.uncertainty), cov / spread if spread > 0 else 0.0,
        mean_and_uncertainty(kl), percentiles(kl, KLD_ROWS), mean_and_uncertainty(dp), percentiles(dp, DP_ROWS), rms(dp),
        proportion(same_top, n),
    )
