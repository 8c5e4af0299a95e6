"""How numbers read in every report: a value, an interval, llama.cpp's `x ± u %`, accuracy points and shares."""

from __future__ import annotations


def pm(stats: dict, label: str) -> str:
    """llama.cpp's `x ± u %` of one of its statistics."""
    return f"{stats[label]:.3f} ± {stats[label + ' uncertainty']:.3f} %"


def kl(divergence) -> str:
    """A mean KL beside its interval (statistics.Divergence): "0.0465 [0.0427, 0.0502]"."""
    return f"{divergence.kl:.4f} {kl_interval((divergence.low, divergence.high))}"


def dnll(delta) -> str:
    """A dNLL beside its interval (statistics.Delta): "+0.0172 [-0.0009, +0.0362]"."""
    return with_interval(delta.dnll, (delta.low, delta.high))


def kl_interval(bounds) -> str:
    """A KL's interval: "[0.0427, 0.0502]"."""
    return f"[{bounds[0]:.4f}, {bounds[1]:.4f}]"


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


def points(difference: float, low: float, high: float) -> str:
    """An accuracy difference and its interval, in points: "+1.1 [-0.6, +2.8]"."""
    return f"{100 * difference:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def share(kept: float, low: float, high: float) -> str:
    """Accuracy kept and its interval: "100.6 % [98.9, 102.2]"."""
    return f"{100 * kept:.1f} % [{100 * low:.1f}, {100 * high:.1f}]"
