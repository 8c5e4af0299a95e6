"""surgery: find, rewrite and measure the transformer blocks of exported ONNX language models.

The public API, importable from the package itself (docs/api.md has a worked example):

    import surgery
    subject = surgery.load("graphs/tiny-llama")          # read, check, find the blocks
    result = surgery.parallelize(subject, layers=[0, 1])  # a new model; the input is untouched
    surgery.write(result.model, "out/tiny-parallel", like="graphs/tiny-llama")

`import surgery` stays light (no onnx, no numpy, no torch): each name below is imported from its module on first
use (PEP 562). No name here is a sub-package's name (`surgery.measure`, `surgery.jobs`, ... stay packages).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from surgery.version import __version__

if TYPE_CHECKING:
    from surgery.model.subject import Subject

# public name -> "module:attribute"; read on first use by __getattr__
_API = {
    # models and their blocks
    "Subject": "surgery.model.subject:Subject",
    "BlockMap": "surgery.model.blocks:BlockMap",
    "find_blocks": "surgery.model.blocks:find_blocks",
    "describe": "surgery.model.facts:describe",
    "save": "surgery.files.graph:save",
    "write": "surgery.files.graph:write",
    "SurgeryError": "surgery.errors:SurgeryError",
    # passes
    "parallelize": "surgery.passes:parallelize",
    "compensate": "surgery.passes:compensate",
    "ablate": "surgery.passes:ablate",
    "fuse": "surgery.passes:fuse",
    "apply_pass": "surgery.passes:apply_pass",
    "Fix": "surgery.passes:Fix",
    "Change": "surgery.passes:Change",
    "SurgeryResult": "surgery.passes:SurgeryResult",
    # the fit and the selection
    "fit": "surgery.compensation.fitting:fit",
    "FitResult": "surgery.compensation.equations:FitResult",
    "select_layers": "surgery.jobs.select:select_layers",
    "Budget": "surgery.jobs.select:Budget",
    "Selection": "surgery.jobs.select:Selection",
    "auto": "surgery.jobs.job:auto",
    # settings: the commands' options, grouped and handed down whole
    "JobSettings": "surgery.jobs.job:JobSettings",
    "DataSettings": "surgery.text.data:DataSettings",
    "FitSettings": "surgery.compensation.fitting:FitSettings",
    "SelectionSettings": "surgery.jobs.select:SelectionSettings",
    "LatencySettings": "surgery.measure.timing:LatencySettings",
    "Resources": "surgery.engine.cluster:Resources",
    "DiagnoseSettings": "surgery.diagnostics.diagnose:DiagnoseSettings",
    "TaskSettings": "surgery.tasks.accuracy:TaskSettings",
    # corpora and measurements
    "windows": "surgery.text.data:windows",
    "Windows": "surgery.text.data:Windows",
    "perplexity": "surgery.measure.scoring:perplexity",
    "compare": "surgery.measure.scoring:compare",
    "divergence": "surgery.measure.statistics:divergence",
    "delta": "surgery.measure.statistics:delta",
    "latency": "surgery.measure.timing:latency",
    "task_accuracy": "surgery.tasks.accuracy:task_accuracy",
    "Perplexity": "surgery.measure.statistics:Perplexity",
    "Divergence": "surgery.measure.statistics:Divergence",
    "Delta": "surgery.measure.statistics:Delta",
    "diagnose": "surgery.diagnostics.diagnose:diagnose",
    "Diagnosis": "surgery.diagnostics.diagnose:Diagnosis",
}

__all__ = ["__version__", "load", *_API]


def load(path: str | Path) -> Subject:
    """Read an ONNX model, check it and find its transformer blocks.

    The model is read once, in the plain view every pass works on (residual adds fused into a normalisation are
    split out; `save` and `write` join them back). External data stays on disk until a pass reads it.

    Args:
        path: an .onnx file, or a folder holding one (`model.onnx` from `surgery export`, a GenAI builder folder).

    Returns:
        A `Subject`: the model (`.model`, an `onnx_ir.Model`) with its blocks (`.blocks`, one `BlockMap` per layer),
        to hand to any pass, `fit`, `select_layers` or `perplexity`.

    Raises:
        SurgeryError: the path holds no ONNX model, the file is not a valid one (external data outside its folder,
            a value read before it is made, ...), or the graph has no transformer blocks; one line naming the file.
    """
    from surgery.model.subject import Subject

    return Subject.load(path)


def __getattr__(name: str):
    try:
        module, attr = _API[name].split(":")
    except KeyError:
        raise AttributeError(f"module 'surgery' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
