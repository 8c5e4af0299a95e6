"""Regenerate the tiny committed fixtures: a BPE tokenizer and a few exported tiny random decoders.

    python graphs/make_fixtures.py            # needs surgery[export]

Each fixture folder is what `surgery export` writes (model.onnx with a KV cache, config, tokenizer),
so core tests and a quick demo run without torch. Weights are random (seeded) and norm scales
and biases are perturbed away from 1 / 0 so that no two layers share an initializer.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from surgery.data import default_corpus  # noqa: E402

VOCAB = 512
TOKENIZER = HERE / "tokenizer"
BOS = "<|endoftext|>"


def make_tokenizer(folder: Path = TOKENIZER) -> None:
    """Train a byte-level BPE tokenizer on the default corpus; it prepends BOS like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[BOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(default_corpus().split("\n\n"), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=BOS, model_input_names=["input_ids", "attention_mask"]
    )
    fast.save_pretrained(folder)


def tiny_config(family: str, **overrides):
    """A tiny config of `family`; the same builder the tests use."""
    import transformers as T

    common = dict(vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    configs = {
        "gpt2": lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0),
        "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                            use_parallel_residual=False, rotary_pct=0.5, **common),
        "gpt_neox_parallel": lambda: T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                                     num_attention_heads=4, use_parallel_residual=True, rotary_pct=0.5, **common),
        "llama": lambda: T.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, **common),
        "qwen2": lambda: T.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, **common),
        # norms on the branch outputs: Gemma 2 before and after each branch, OLMo 2 after only
        "gemma2": lambda: T.Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, sliding_window=256, pad_token_id=0, **common),
        "olmo2": lambda: T.Olmo2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, pad_token_id=0, **common),
        "mistral": lambda: T.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                           num_key_value_heads=2, sliding_window=None, **common),
    }
    config = configs[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(family: str, seed: int = 0, **overrides):
    """A tiny random causal LM with every norm scale and bias made distinct."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm scales (1 -> 1 +- 0.2) and biases (0 -> +- 0.2)
                p.add_(0.2 * torch.randn_like(p))
    return model


def save_tiny(family: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny HF model folder (weights, config, tokenizer) that `surgery export` reads."""
    from transformers import AutoTokenizer

    model = tiny_model(family, seed, **overrides)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def main() -> None:
    from surgery.export import export

    make_tokenizer()
    for family in ("llama", "gpt2", "gpt_neox_parallel"):
        target = HERE / f"tiny-{family.replace('_', '-')}"
        shutil.rmtree(target, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            export(str(save_tiny(family, Path(tmp) / "hf")), target)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
