"""What the config files beside a model say, read in one place: config.json (Hugging Face) and
genai_config.json (the ONNX Runtime GenAI builder's)."""

from __future__ import annotations

import json
from pathlib import Path


def read(folder: Path) -> tuple[dict, dict]:
    """config.json and genai_config.json's "model" section in `folder`; {} for a file that is missing or not JSON."""
    def load(name: str) -> dict:
        try:
            data = json.loads((Path(folder) / name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    genai = load("genai_config.json").get("model")
    return load("config.json"), genai if isinstance(genai, dict) else {}


def kv_sizes(folder: Path) -> tuple[int, int] | None:
    """(KV heads, head size) from genai_config.json's decoder, else config.json; None when neither states them."""
    hf, genai = read(folder)
    decoder = genai.get("decoder") or {}
    if isinstance(decoder.get("num_key_value_heads"), int) and isinstance(decoder.get("head_size"), int):
        return decoder["num_key_value_heads"], decoder["head_size"]
    heads = hf.get("num_attention_heads") or hf.get("n_head")
    kv_heads = hf.get("num_key_value_heads") or heads
    head_size = hf.get("head_dim") or ((hf.get("hidden_size") or hf.get("n_embd") or 0) // heads if isinstance(heads, int) and heads else None)
    if isinstance(kv_heads, int) and isinstance(head_size, int) and head_size > 0:
        return kv_heads, head_size
    return None


def position_limit(folder: Path) -> int | None:
    """The model's position limit: config.json's max_position_embeddings or n_positions, else genai_config.json's context_length."""
    hf, genai = read(folder)
    for data, key in ((hf, "max_position_embeddings"), (hf, "n_positions"), (genai, "context_length")):
        if isinstance(data.get(key), int):
            return data[key]
    return None
