"""Graphs as people deploy them, built from a Hugging Face folder the way their users build them:

- genai_build: the ONNX Runtime GenAI model builder (`python -m onnxruntime_genai.models.builder`),
  fp32 or int4, for CPU: SkipSimplifiedLayerNormalization, GroupQueryAttention, MatMulNBits,
  genai_config.json and no config.json.
- ort_optimize: the ORT transformers optimizer (`onnxruntime.transformers.optimizer.optimize_model`)
  on one of our exports: Skip(Simplified)LayerNormalization, QuickGelu / FastGelu, RotaryEmbedding.

Tests and benchmarks call these; they need `pip install -e '.[export,genai]'`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

MODEL = "model.onnx"


def genai_build(hf: Path, out: Path, precision: str = "fp32", cache: Path | None = None) -> Path:
    """Build `hf` with the GenAI model builder for CPU into the folder `out`; return `out`."""
    cache = cache or out.parent / f".{out.name}-cache"
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True)
    shutil.rmtree(cache, ignore_errors=True)
    if done.returncode != 0 or not (out / MODEL).is_file():
        raise RuntimeError(f"the GenAI builder failed on {hf}:\n{done.stderr[-3000:]}")
    return out


def ort_optimize(folder: Path, out: Path, model_type: str = "gpt2", level: int = 2) -> Path:
    """Run the ORT transformers optimizer on folder/model.onnx; write out/model.onnx beside copies of the
    folder's other files (config, tokenizer); return `out`."""
    from onnxruntime.transformers.optimizer import optimize_model

    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.is_file() and item.suffix not in (".onnx", ".data", ".onnx_data"):
            shutil.copy2(item, out / item.name)
    optimized = optimize_model(str(folder / MODEL), model_type=model_type, num_heads=0, hidden_size=0, opt_level=level)
    optimized.save_model_to_file(str(out / MODEL))
    return out


def genai_greedy(folder: Path, prompt: list[int], steps: int) -> list[int]:
    """The `steps` tokens onnxruntime_genai generates greedily after the token ids `prompt`, on CPU."""
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.clear_providers()
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + steps)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens
