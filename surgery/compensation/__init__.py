"""The compensation fix: its fit (streamed normal equations over fit windows), the solve, and the requantization of
MatMulNBits weights it is folded into. `compensation.fit` and `compensation.fit_passes` are the fit's entry points."""

from surgery.compensation.fitting import REQUANTIZE, Accumulator, fit, fit_passes

__all__ = ["REQUANTIZE", "Accumulator", "fit", "fit_passes"]
