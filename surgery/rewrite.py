"""Rewrites of named blocks, file to file: load, check the output path, choose the layers, apply a pass, and
write the result atomically. What `surgery parallelize --layers SPEC` and `surgery ablate` run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from surgery import graph, job, runtime
from surgery.errors import SurgeryError
from surgery.layers import parse_layers
from surgery.passes import SurgeryResult
from surgery.subject import Subject


def fit_kind(compensate: bool | None, calibrate: bool, auto: bool) -> str | None:
    """The fix parallelize fits: "gate" (--calibrate), "full" (--compensate; the default for --layers auto) or None."""
    if calibrate and compensate is False:
        raise SurgeryError("--calibrate is a form of compensation (the scalar gate); drop --no-compensate or --calibrate")
    if calibrate:
        return "gate"
    return "full" if (compensate if compensate is not None else auto) else None


def rewrite_file(model_path: Path, out_path: Path, layers: str, apply: Callable[[Subject, set[int]], SurgeryResult]) -> tuple[SurgeryResult, Path]:
    """apply(model, chosen layers) on the model at `model_path` (read once, as a Subject), written to `out_path`; the
    result and the written file."""
    subject = Subject(graph.load(model_path), str(model_path))
    graph.check_output(out_path, model_path, subject.model)
    chosen = parse_layers(layers, subject.n_layers)
    result = apply(subject, chosen)
    return result, graph.write(result.model, out_path, like=model_path)


def parallelize_file(model_path: Path, out_path: Path, layers: str, *, fit: str | None = None, fused: bool = False, corpus=None,
                     seq_len: int = 256, fit_windows: int = 64, tokenizer=None, options: runtime.Options = runtime.Options(),
                     fit_memory: int | str | None = None, requantize: str = "gptq", input_side: bool = True):
    """The named blocks in parallel form: plain, or with the fix `fit` fitted on calibration windows and folded in; fused or not."""
    def apply(model, chosen):
        fixes = None
        if fit is not None:
            fixes = job.fit_fixes(model, model_path, chosen, fit=fit, corpus=corpus, seq_len=seq_len, fit_windows=fit_windows,
                                  tokenizer=tokenizer, options=options, fit_memory=fit_memory, requantize=requantize,
                                  input_side=input_side)
        return job.rewrite(model, chosen, fused=fused, fixes=fixes)

    return rewrite_file(model_path, out_path, layers, apply)
