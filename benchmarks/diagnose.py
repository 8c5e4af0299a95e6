"""The diagnostics through a torch forward-hook implementation vs `surgery diagnose` on ONNX Runtime,
on the same calibration windows of SmolLM2-135M: agreement and wall time.

    python benchmarks/diagnose.py [--windows 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import time

from common import smollm2, table

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from surgery import data
from surgery.diagnostics import diagnose
from surgery.diagnostics.geometry import alignment, effective_rank, mean_pairwise_cosine
from surgery.export import resolve_source


def torch_diagnostics(model, windows) -> dict:
    """Deficit, diversity (MPC and effective rank), C_l, C_l^stream and alpha_l from hooks; the mlp's second
    evaluation runs in the hook. The statistics use the same NumPy functions as surgery: what differs is
    where the tensors come from (torch modules vs ONNX Runtime outputs)."""
    layers = model.model.layers
    n = len(layers)
    align, count = np.zeros(n), np.zeros(n)
    sums = np.zeros((n, 5))
    div = {k: np.zeros(n) for k in ("pre", "mid", "post")}
    rank = {k: np.zeros(n) for k in ("pre", "mid", "post")}
    state: dict = {}

    def pre_hook(layer):
        def hook(module, args, kwargs):
            state[layer] = {"pre": (args[0] if args else kwargs["hidden_states"])[0, 1:]}
        return hook

    def attn_hook(layer):
        def hook(module, args, out):
            state[layer]["attn"] = out[0][0, 1:]
        return hook

    def ln2_hook(layer):
        def hook(module, args):
            state[layer]["mid"] = args[0][0, 1:]
        return hook

    def mlp_hook(layer):
        def hook(module, args, out):
            block = layers[layer]
            x = state[layer]["pre"]
            state[layer]["mlp_h"] = out[0, 1:]
            state[layer]["mlp_x"] = block.mlp.forward(block.post_attention_layernorm.forward(x))  # .forward skips hooks
        return hook

    def post_hook(layer):
        def hook(module, args, kwargs, out):
            s = state[layer]
            y = (out[0] if isinstance(out, tuple) else out)[0, 1:]
            x, a, h = (s[k].double().numpy() for k in ("pre", "attn", "mid"))
            y64, mh, mx = y.double().numpy(), s["mlp_h"].double().numpy(), s["mlp_x"].double().numpy()
            cos = alignment(x, a, y64)
            align[layer] += cos.sum()
            count[layer] += len(cos)
            sums[layer] += [np.sum((mh - mx) ** 2), np.sum(mh**2), np.sum(y64**2), np.sum(mh * mx), np.sum(mx**2)]
            for key, v in (("pre", x), ("mid", h), ("post", y64)):
                div[key][layer] += 1 - mean_pairwise_cosine(v)
                rank[key][layer] += effective_rank(v)
        return hook

    handles = []
    for i, block in enumerate(layers):
        handles += [
            block.register_forward_pre_hook(pre_hook(i), with_kwargs=True),
            block.self_attn.register_forward_hook(attn_hook(i)),
            block.post_attention_layernorm.register_forward_pre_hook(ln2_hook(i)),
            block.mlp.register_forward_hook(mlp_hook(i)),
            block.register_forward_hook(post_hook(i), with_kwargs=True),
        ]
    with torch.no_grad():
        for row in windows.ids:
            model(input_ids=torch.from_numpy(row[None]), use_cache=False)
    for h in handles:
        h.remove()
    w = len(windows)
    return {
        "alignment": align / count,
        "c": sums[:, 0] / sums[:, 1],
        "c_stream": sums[:, 0] / sums[:, 2],
        "alpha": sums[:, 3] / sums[:, 4],
        "div_pre": div["pre"] / w,
        "div_mid": div["mid"] / w,
        "div_post": div["post"] / w,
        "erank_pre": rank["pre"] / w,
        "erank_mid": rank["mid"] / w,
        "erank_post": rank["post"] / w,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    folder = smollm2()
    windows = data.windows(folder, seq_len=args.seq_len, max_windows=args.windows, part="calibration")

    # eval_windows only sizes the dNLL ground truth that "defect" also measures; it is not compared here.
    report = diagnose(folder, seq_len=args.seq_len, windows=args.windows, eval_windows=1, only=("deficit", "diversity", "defect", "gate"))
    ort_seconds = report["seconds"]["probe"]  # the one pass that gives every score below

    src = resolve_source("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, attn_implementation="eager").eval()
    start = time.perf_counter()
    ref = torch_diagnostics(model, windows)
    torch_seconds = time.perf_counter() - start

    ours = {
        "alignment": report["deficit"]["alignment"],
        "c": report["defect"]["c"],
        "c_stream": report["defect"]["c_stream"],
        "alpha": report["gate"]["alpha"],
        "div_pre": report["diversity"]["pre"]["diversity"],
        "div_mid": report["diversity"]["mid"]["diversity"],
        "div_post": report["diversity"]["post"]["diversity"],
        "erank_pre": report["diversity"]["pre"]["effective_rank"],
        "erank_mid": report["diversity"]["mid"]["effective_rank"],
        "erank_post": report["diversity"]["post"]["effective_rank"],
    }
    rows = []
    for key, values in ours.items():
        a, b = np.array(values, dtype=float), ref[key]
        rows.append({
            "quantity": key,
            "max abs diff": f"{np.max(np.abs(a - b)):.2e}",
            "max rel diff": f"{np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)):.2e}",
            "model mean (ORT)": f"{np.mean(a):.4f}",
            "model mean (torch)": f"{np.mean(b):.4f}",
        })
    print(f"SmolLM2-135M, {len(windows)} calibration windows x {args.seq_len} tokens, {torch.get_num_threads()} threads")
    print(table(rows, list(rows[0])))
    print(f"\nwall time, scores for all 30 layers: ORT probe pass {ort_seconds:.2f} s, torch hooks {torch_seconds:.2f} s "
          f"(torch / ORT {torch_seconds / ort_seconds:.2f}x)")


if __name__ == "__main__":
    main()
