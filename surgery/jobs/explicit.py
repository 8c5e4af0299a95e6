"""Rewrites of named blocks, file to file: load, check the output path, choose the layers, apply a pass, and
write the result atomically. What `surgery parallelize --layers SPEC` and `surgery ablate` run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from surgery.compensation.fitting import FitSettings
from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.jobs import job
from surgery.model.layers import parse_layers
from surgery.model.subject import Subject
from surgery.passes import SurgeryResult
from surgery.text.data import DataSettings


def fit_kind(compensate: bool | None, calibrate: bool, auto: bool) -> str | None:
    """The fix parallelize fits: "gate" (--calibrate), "full" (--compensate; the default for --layers auto) or None."""
    if calibrate and compensate is False:
        raise SurgeryError("--calibrate is a form of compensation (the scalar gate); drop --no-compensate or --calibrate")
    if calibrate:
        return "gate"
    return "full" if (compensate if compensate is not None else auto) else None


def edit_file(model_path: Path, out_path: Path, layers: str, apply: Callable[[Subject, set[int]], SurgeryResult]) -> tuple[SurgeryResult, Path]:
    """apply(model, chosen layers) on the model at `model_path` (read once, as a Subject), written to `out_path`; the
    result and the written file."""
    subject = Subject(graph.load(model_path), str(model_path))
    graph.check_output(out_path, model_path, subject.model)
    chosen = parse_layers(layers, subject.n_layers)
    result = apply(subject, chosen)
    return result, graph.write(result.model, out_path, like=model_path)


def parallelize_file(model_path: Path, out_path: Path, layers: str, fit: FitSettings | None = None, fused: bool = False,
                     data: DataSettings = DataSettings(), options: runtime.Options = runtime.Options()):
    """The named blocks in parallel form: plain, or with fixes fitted as `fit` says on `data`'s calibration windows and folded in; fused or not."""
    def apply(subject, chosen):
        fixes = job.fit_fixes(subject, chosen, fit, data, options) if fit is not None else None
        return job.parallel_form(subject, chosen, fused=fused, fixes=fixes)

    return edit_file(model_path, out_path, layers, apply)
