"""How much of the fix's input-side residual is the per-token RMS scale? SmolLM2-135M, the HF model with hooks.

    python benchmarks/input_scale.py [--layers 5,7,21,23,24,29]

The parallel block's mlp reads u = ln2(x) where the sequential one read v = ln2(x + a) (x: resid_pre, a: the
attention output). With RMSNorm, v - u = u (s - 1) + s g a / rms(x), s = rms(x) / rms(x + a): a per-token
rescaling of u, which no linear map of u can follow, and the attention's own part. On the main job's 64 fit windows
(token 0 left out, folds alternating by window, the ridge chosen on the held-out fold as compensation.fit chooses
it), the held-out residual fraction of v - u regressed on:
- [u, 1]: the input side as built (compensation.fit's input_residual);
- [u, 1, (s - 1) u] with the true s: what any per-token scale could add at best;
- [u, 1, (s^ - 1) u], s^ a least-squares prediction of s from [u, 1] (one more d -> 1 MatMul a block, if folded);
and of v / s - u on [u, 1]: the attention's part alone, with the scale known.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import main_job_windows, smollm2

from surgery.equations import RIDGES
from surgery.export import resolve_source


def held_out(z: np.ndarray, target: np.ndarray, folds: np.ndarray) -> float:
    """The least energy a ridge fit on fold 0 (ridge times diag(Z'Z), over RIDGES) leaves on fold 1, as a fraction."""
    z0, t0, z1, t1 = z[folds == 0], target[folds == 0], z[folds == 1], target[folds == 1]
    g0, c0 = z0.T @ z0, z0.T @ t0
    return min(np.sum((t1 - z1 @ np.linalg.solve(g0 + r * np.diag(np.diag(g0)), c0)) ** 2) for r in RIDGES) / np.sum(t1**2)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="5,7,21,23,24,29")
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    src = resolve_source("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, attn_implementation="eager").eval()
    fit, _, _ = main_job_windows(smollm2())
    seen: dict[int, list] = {l: [] for l in layers}
    for l in layers:
        block, state = model.model.layers[l], {}
        block.register_forward_pre_hook(lambda m, a, kw, state=state: state.update(x=a[0] if a else kw["hidden_states"]), with_kwargs=True)

        def after(module, a, out, block=block, l=l, state=state):
            attn, x, ln = out[0] if isinstance(out, tuple) else out, state["x"], block.post_attention_layernorm
            rms = lambda t: torch.sqrt(t.pow(2).mean(-1, keepdim=True) + ln.variance_epsilon)  # noqa: E731
            seen[l].append([t[0, 1:].double().numpy() for t in (ln(x), ln(x + attn), rms(x) / rms(x + attn))])

        block.self_attn.register_forward_hook(after)
    with torch.no_grad():
        for i in range(len(fit)):
            model(input_ids=torch.from_numpy(fit.ids[i : i + 1]), use_cache=False)
    for l, rows in seen.items():
        u, v, s = (np.concatenate([r[k] for r in rows]) for k in range(3))
        folds = np.concatenate([np.full(len(r[0]), i % 2) for i, r in enumerate(rows)])
        z = np.concatenate([u, np.ones((len(u), 1))], 1)
        s_hat = z @ np.linalg.lstsq(z[folds == 0], s[folds == 0], rcond=None)[0]
        print(f"block {l}: [u, 1] {held_out(z, v - u, folds):.4f}; with (s - 1) u {held_out(np.concatenate([z, (s - 1) * u], 1), v - u, folds):.4f}; "
              f"with (s^ - 1) u {held_out(np.concatenate([z, (s_hat - 1) * u], 1), v - u, folds):.4f} (s from [u, 1]: R^2 "
              f"{1 - held_out(z, s - s.mean(), folds):.3f}, std(s) {s.std():.4f}); v / s - u on [u, 1] {held_out(z, v / s - u, folds):.4f}", flush=True)


if __name__ == "__main__":
    main()
