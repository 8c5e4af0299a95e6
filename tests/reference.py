"""Independent reference: the HF torch model with forward hooks on every block."""

from __future__ import annotations

import numpy as np
import torch

from tests.helpers import FAMILIES

# model_type -> (blocks, attention, mlp, ln2) submodule names, from the families' table (a family's name is its
# model_type but for gpt_neox_parallel, a gpt_neox): the attention and mlp modules' outputs are attn_out and
# mlp_out, ln2's input is resid_mid (the module the mlp branch reads it with).
LAYOUT = {name: family.layout for name, family in FAMILIES.items() if family.layout}


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


def edit(out: torch.Tensor, ref: torch.Tensor, mode: str, scale: float | None = None) -> torch.Tensor:
    """The part of a branch output `out` kept by `mode`, relative to the direction of `ref` (per token)."""
    if mode == "remove":
        return out * 0
    if mode == "scale":
        return out * scale
    d = ref / ref.norm(dim=-1, keepdim=True)
    radial = (out * d).sum(-1, keepdim=True) * d
    return radial if mode == "radial" else out - radial


class Edits:
    """Forward hooks that make the HF model compute what a rewritten graph computes.

    parallel: blocks whose ln2 reads resid_pre. branch_edits: (branch, mode, layers, scale) applied
    in order, the mlp relative to ln2's input, attention relative to resid_pre; keep_sink: not to token 0. fixes: layer ->
    (w_a, w_p, b) arrays: that block's mlp output P becomes P + A w_a + P w_p + b (A = attn output),
    so resid_post = resid_pre + A + P + A w_a + P w_p + b: the compensated parallel block; (w_a, w_p, b, w_in, b_in):
    and ln2's output u, the mlp's input, becomes u + u w_in + b_in first (P is the mlp's output on that).
    """

    def __init__(self, model, parallel=(), branch_edits=(), fixes=None, keep_sink=False):
        self.model, self.parallel, self.branch_edits, self.keep_sink = model, set(parallel), list(branch_edits), keep_sink
        self.fixes = {layer: tuple(torch.as_tensor(np.asarray(a), dtype=torch.float32) for a in fix) for layer, fix in (fixes or {}).items()}
        self.handles = []

    def __enter__(self):
        blocks_path, attn_name, mlp_name, ln2_name = LAYOUT[self.model.config.model_type]
        for layer, block in enumerate(self.model.get_submodule(blocks_path)):
            state = {}

            def save_pre(module, args, kwargs, state=state):
                state["pre"] = args[0] if args else kwargs["hidden_states"]

            def ln2_in(module, args, state=state, layer=layer):
                if layer in self.parallel:
                    args = (state["pre"],) + tuple(args[1:])
                state["ln2_in"] = args[0]
                return args

            def branch_hook(kind, layer=layer, state=state):
                def hook(module, args, output):
                    first = output[0] if isinstance(output, tuple) else output
                    for branch, mode, layers, scale in self.branch_edits:
                        if branch == kind and layer in layers:
                            ref = state["ln2_in"] if kind == "mlp" else state["pre"]
                            edited = edit(first, ref, mode, scale)
                            if self.keep_sink:  # the run starts at position 0: token 0 keeps its output
                                edited = torch.cat([first[:, :1], edited[:, 1:]], dim=1)
                            first = edited
                    if kind == "attn":
                        state["attn"] = first
                    elif layer in self.fixes:
                        w_a, w_p, b = self.fixes[layer][:3]
                        first = first + state["attn"] @ w_a + first @ w_p + b
                    return (first,) + tuple(output[1:]) if isinstance(output, tuple) else first

                return hook

            def ln2_out(module, args, output, layer=layer):
                if layer in self.fixes and len(self.fixes[layer]) == 5:
                    w_in, b_in = self.fixes[layer][3:]
                    return output + output @ w_in + b_in
                return output

            self.handles += [
                block.register_forward_pre_hook(save_pre, with_kwargs=True),
                block.get_submodule(ln2_name).register_forward_hook(ln2_out),
                block.get_submodule(ln2_name).register_forward_pre_hook(ln2_in),
                block.get_submodule(attn_name).register_forward_hook(branch_hook("attn")),
                block.get_submodule(mlp_name).register_forward_hook(branch_hook("mlp")),
            ]
        return self.model

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def edited_logits(model, input_ids: np.ndarray, parallel=(), branch_edits=(), fixes=None, keep_sink=False) -> np.ndarray:
    with Edits(model, parallel, branch_edits, fixes, keep_sink), torch.no_grad():
        return model(input_ids=torch.from_numpy(input_ids), use_cache=False).logits.float().numpy()


def dequantize_matmul_nbits(packed: np.ndarray, scales: np.ndarray, k: int, n: int, bits: int, block_size: int,
                            zero_points: np.ndarray | None = None) -> np.ndarray:
    """The [K, N] float weight a MatMulNBits node multiplies by, from its [N, blocks, block_size * bits / 8]
    packed integers (low bits first in each byte) and [N * blocks] scales; zero point 2^(bits-1) unless given."""
    assert bits == 4 and zero_points is None, "only the builder's symmetric 4-bit weights"
    blocks = packed.shape[1]
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks * block_size).astype(np.float64)
    w = (q - 8.0) * np.repeat(np.asarray(scales, np.float64).reshape(n, blocks), block_size, axis=1)
    return w[:, :k].T


def with_genai_int4_weights(model, onnx_model) -> None:
    """Give the HF llama `model` the dequantized weights of its GenAI builder int4 export, in place
    (the builder names its MatMulNBits weights after the modules: model.layers.0.attn.qkv_proj.MatMul.weight_Q4;
    with tied embeddings the token table is the same quantized lm_head weight, read by GatherBlockQuantized)."""
    initializers = onnx_model.graph.initializers
    params = dict(model.named_parameters())
    for node in onnx_model.graph:
        if node.op_type != "MatMulNBits":
            continue
        a = {key: attr.value for key, attr in node.attributes.items()}
        w = dequantize_matmul_nbits(initializers[node.inputs[1].name].const_value.numpy(),
                                    initializers[node.inputs[2].name].const_value.numpy(), a["K"], a["N"], a["bits"], a["block_size"])
        module = node.inputs[1].name.removesuffix(".MatMul.weight_Q4")
        targets = {"attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn.o_proj": ("self_attn.o_proj",)}
        prefix, _, last = module.rpartition("layers.")
        names = [module] if not prefix else [f"{prefix}layers.{last.split('.')[0]}.{t}" for t in targets.get(last.split(".", 1)[1], (last.split(".", 1)[1],))]
        start = 0
        for name in names:
            weight = model.get_output_embeddings().weight if name == "lm_head" else params[f"{name}.weight"]  # tied: one tensor
            rows = weight.shape[0]
            with torch.no_grad():
                weight.copy_(torch.from_numpy(w[:, start : start + rows].T.astype(np.float32)))
            start += rows
        assert start == w.shape[1], module


def greedy(model, prompt: list[int], steps: int, parallel=()) -> list[int]:
    """The `steps` tokens the HF model picks greedily after `prompt`, with the `parallel` blocks made parallel by hooks."""
    ids = list(prompt)
    with Edits(model, parallel=parallel), torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]
