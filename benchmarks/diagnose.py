"""The diagnostics through a torch forward-hook implementation vs `surgery diagnose` on ONNX Runtime,
on the same calibration windows of SmolLM2-135M: agreement and wall time.

    python benchmarks/diagnose.py [--windows 4] [--seq-len 256] [--repeats 3]
    python benchmarks/diagnose.py --losses [--windows 4] [--seq-len 256]   # the losses section alone, three ways
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

from common import smollm2, table

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from surgery import data
from surgery.diagnostics import diagnose, graphs
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


def _all_losses(report) -> np.ndarray:
    """Every loss of the losses section, base + dNLL, interval ends included, in one order."""
    base, d, a = report["ablation"]["base_loss"], report["defect"], report["ablation"]
    dnll = list(d["dnll_parallel"]) + [x for pair in d["dnll_parallel_interval"] for x in pair]
    for key in ("per_layer", "per_layer_interval", "all_layers", "all_layers_interval", "all_layers_keep_sink", "all_layers_keep_sink_interval"):
        dnll += list(np.ravel([a[key][b][m] for b in a[key] for m in a[key][b]]))
    return base + np.array([0.0] + dnll)


def losses_section(folder, windows: int, seq_len: int) -> None:
    """Time diagnose's losses section (the 30 x 7 single-layer and 10 all-layer dNLLs of defect + ablation on the
    evaluation windows) as it was (Where switches, every run a whole forward), with If switches only, and as it is
    (If switches, each single-layer run starting at its block from the unchanged run's resid_pre); compare the numbers."""
    board = graphs.switchboard
    eager = mock.patch.object(graphs, "switchboard", lambda model, kinds, lazy: board(model, kinds, lazy=False))
    whole = mock.patch.object(graphs, "resumable", lambda board, blocks: None)
    ways = {"Where switches, whole forwards": [eager, whole], "If switches, whole forwards": [whole], "If switches, prefix reuse": []}
    results = {}
    for way, patches in ways.items():
        for patch in patches:
            patch.start()
        results[way] = diagnose(folder, seq_len=seq_len, windows=1, eval_windows=windows, only=("defect", "ablation"))
        for patch in patches:
            patch.stop()
    before = _all_losses(results["Where switches, whole forwards"])
    rows = []
    for way, report in results.items():
        diff = np.abs(_all_losses(report) - before) / np.abs(before)
        rows.append({"losses section": way, "seconds": f"{report['seconds']['losses']:.1f}", "max rel diff of the losses vs before": f"{diff.max():.1e}"})
    print(f"SmolLM2-135M, {windows} evaluation windows x {seq_len} tokens, {torch.get_num_threads()} threads")
    print(table(rows, list(rows[0])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--losses", action="store_true", help="time only the losses section, before and after prefix reuse")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved ORT / torch runs of the scores (medians)")
    args = parser.parse_args()
    folder = smollm2()
    if args.losses:
        losses_section(folder, args.windows, args.seq_len)
        return
    windows = data.windows(folder, seq_len=args.seq_len, max_windows=args.windows, part="calibration")

    src = resolve_source("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, attn_implementation="eager").eval()
    ort_seconds, torch_seconds = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine
        # eval_windows only sizes the dNLL ground truth that "defect" also measures; it is not compared here.
        report = diagnose(folder, seq_len=args.seq_len, windows=args.windows, eval_windows=1, only=("deficit", "diversity", "defect", "gate"))
        ort_seconds.append(report["seconds"]["probe"])  # the one pass that gives every score below, graph and session included
        start = time.perf_counter()
        ref = torch_diagnostics(model, windows)
        torch_seconds.append(time.perf_counter() - start)
    ort_s, torch_s = float(np.median(ort_seconds)), float(np.median(torch_seconds))

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
    print(f"\nwall time, scores for all 30 layers, median of {args.repeats} interleaved runs: ORT probe pass {ort_s:.2f} s "
          f"(building the graph and session included), torch hooks {torch_s:.2f} s (torch / ORT {torch_s / ort_s:.2f}x)")


if __name__ == "__main__":
    main()
