"""Independent reference: the HF torch model with forward hooks on every block."""

from __future__ import annotations

import numpy as np
import torch

# model_type -> (blocks, attention, mlp, ln2) submodule names; ln2's input is resid_mid.
LAYOUT = {
    "gpt2": ("transformer.h", "attn", "mlp", "ln_2"),
    "gpt_neox": ("gpt_neox.layers", "attention", "mlp", "post_attention_layernorm"),
    "llama": ("model.layers", "self_attn", "mlp", "post_attention_layernorm"),
    "qwen2": ("model.layers", "self_attn", "mlp", "post_attention_layernorm"),
    "mistral": ("model.layers", "self_attn", "mlp", "post_attention_layernorm"),
}


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def block_tensors(model, input_ids: np.ndarray) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """Run `model` on `input_ids`; return logits and, per block, resid_pre / attn_out / resid_mid / mlp_out / resid_post."""
    blocks_path, attn_name, mlp_name, ln2_name = LAYOUT[model.config.model_type]
    parallel = getattr(model.config, "use_parallel_residual", False)
    blocks = model.get_submodule(blocks_path)
    records: list[dict[str, np.ndarray]] = [{} for _ in blocks]
    handles = []

    def keep(layer, name, pick):
        def hook(module, args, *rest):
            records[layer][name] = pick(args, *rest).detach().float().numpy().copy()

        return hook

    for layer, block in enumerate(blocks):
        handles += [
            block.register_forward_pre_hook(
                keep(layer, "resid_pre", lambda a, kw: a[0] if a else kw["hidden_states"]), with_kwargs=True
            ),
            block.register_forward_hook(keep(layer, "resid_post", lambda a, out: _first(out))),
            block.get_submodule(attn_name).register_forward_hook(keep(layer, "attn_out", lambda a, out: _first(out))),
            block.get_submodule(mlp_name).register_forward_hook(keep(layer, "mlp_out", lambda a, out: _first(out))),
        ]
        if not parallel:
            handles.append(
                block.get_submodule(ln2_name).register_forward_pre_hook(keep(layer, "resid_mid", lambda a: a[0]))
            )
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(input_ids), use_cache=False).logits.float().numpy()
    finally:
        for h in handles:
            h.remove()
    return logits, records


def assert_close_to_scale(got: np.ndarray, expected: np.ndarray, tol: float, what: str = "") -> None:
    """max |got - expected| <= tol * max |expected|: float32 error relative to the tensor's own scale.

    Real models carry a few huge residual coordinates (SmolLM2: ~1e4), where float32 reordering
    alone moves elements by more than an absolute 1e-4.
    """
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    err = float(np.abs(got - expected).max()) / max(float(np.abs(expected).max()), 1e-30)
    assert err <= tol, f"{what}: max error {err:.2e} of the tensor's scale (tolerance {tol:.0e})"
