"""Plain helpers several test modules share: tiny HF model builders, token ids, logits, a graph with no blocks.

Tests import these from here, never from one another (conftest's `tiny_export` caches what `save_tiny` builds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from surgery import graph, runtime

IDS = np.random.default_rng(1).integers(0, 512, size=(2, 9))


def save_tiny(family: str, folder: Path, seed: int = 0, **config) -> Path:
    """A tiny random HF folder of `family`: graphs.make_fixtures' families, and Phi-3 (one fused gate_up
    projection) and Gemma 3 text built here the same way; `config` overrides the tiny config's fields."""
    import torch
    import transformers as T

    from graphs.make_fixtures import TOKENIZER, VOCAB
    from graphs.make_fixtures import save_tiny as save_fixture_family

    if family not in ("phi3", "gemma3_text"):
        return save_fixture_family(family, folder, seed=seed, **config)
    torch.manual_seed(seed)
    if family == "phi3":
        phi3 = T.Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0, **config)
        model = T.AutoModelForCausalLM.from_config(phi3, attn_implementation="eager").eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:  # norm scales 1 -> 1 +- 0.2, so that no two layers share an initializer
                    p.add_(0.2 * torch.randn_like(p))
    else:
        gemma3 = T.Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, vocab_size=VOCAB, max_position_embeddings=256, sliding_window=256, bos_token_id=0,
                                    eos_token_id=0, pad_token_id=0, **config)
        model = T.Gemma3ForCausalLM(gemma3)
    model.save_pretrained(folder)
    T.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def logits(model: ir.Model, ids: np.ndarray = IDS, extra: dict | None = None) -> np.ndarray:
    """The graph's logits on `ids`: [batch, pos, vocab] (extra: inputs surgery added, such as a switchboard's)."""
    session = runtime.session(model)
    return session.run(["logits"], runtime.feeds(session, ids, extra=extra))[0]


class Exported:
    """A tiny export from conftest's `tiny_export`, loaded: the ONNX graph and its HF model (eager attention) to hook.

    Each instance loads its own graph and torch model, so a module may hook or edit them; the folders are shared."""

    def __init__(self, tiny):
        from transformers import AutoModelForCausalLM

        self.folder = tiny.onnx
        self.onnx = graph.load(self.folder)
        self.torch = AutoModelForCausalLM.from_pretrained(tiny.hf, attn_implementation="eager").eval()

    def reference(self, parallel=(), branch_edits=()):
        from tests.reference import edited_logits

        return edited_logits(self.torch, IDS, parallel, branch_edits)


def linear_model() -> ir.Model:
    """x -> MatMul -> Relu -> MatMul: a graph with no normalisation or residual."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 4]))
    w = ir.Value(name="w", const_value=ir.tensor(np.eye(4, dtype=np.float32)))
    a = ir.node("MatMul", [x, w])
    r = ir.node("Relu", [a.outputs[0]])
    b = ir.node("MatMul", [r.outputs[0], w])
    g = ir.Graph([x], b.outputs, nodes=[a, r, b], initializers=[w], opset_imports={"": 18})
    return ir.Model(g, ir_version=9)
