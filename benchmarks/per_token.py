"""Study: a per-token correction on top of today's compensated parallel blocks (SmolLM2-135M, PyTorch, CPU).

What. A compensated parallel block computes  y' = x + A (I + w_a) + P (I + w_p) + b,  P = mlp(ln2(x) (I + w_in) + b_in),
where the sequential block computes y = h + M, h = x + A, M = mlp(ln2(h)). The linear fix cannot follow the
token-dependent part of M's dependence on A (the mlp's Jacobian changes per token). This script fits, per block,
    corr = ((A U) * (P V)) W,   U, V: [d, r], W: [r, d]
to the residual R = y - y' and measures whether it helps:
  1. hooks on the original HF model collect x, A, M on the 64 fit and 16 selection windows (token 0, the attention
     sink, left out as in surgery's fits); P and R with today's fix (surgery.compensation.fit, cached in --fixes);
  2. the fit, float64, closed form per step: greedy rank-1 components with deflation (for each: w = top singular
     vector of R, then rounds of u | v | w: u and v by ridge least squares of t = R w on A * (P v) and P * (A u), w = R'h/|R'h|),
     the ridge of every solve chosen on a held-out fold of the fit windows (even / odd windows, as surgery does);
     at the end W is refitted jointly (ridge least squares of R on the r features), for each rank (prefixes of the greedy U, V);
  3. held-out (32 evaluation windows) mean token KL and top-1 agreement vs the original model, all LAYERS replaced
     in the model's own stream: today's fix vs today's fix + the correction, 95 % bootstrap CI over windows;
     first, the torch re-implementation of today's blocks is checked against surgery's rewritten ONNX graph.
Run:   nice -n 19 .venv/bin/python benchmarks/per_token.py [--rank 4,8,16] [--layers 12,15,21,24,25,26,27,29]
Prints per-layer checks and fits, the ONNX check, and a closing markdown table (rank, fit seconds, FLOPs fraction,
held-out energy removed, KL [CI], top-1). Single-threaded (2-core machine shared with other work).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from surgery import compensation, data, graph, runtime
from surgery.equations import RIDGES
from surgery.passes import Fix

ROOT = Path(__file__).resolve().parents[1]
MODEL, HF, SCRATCH = ROOT / "out" / "smollm2", ROOT / "out" / "smollm2-hf", ROOT / "out" / "per_token"
torch.set_num_threads(1)
F64 = torch.float64
FIELDS = ("w_a", "w_p", "b", "w_in", "b_in")  # a compensated block's fix, in the order every tuple here holds it


def windows(**kw):
    """data.windows of the default corpus (text and the model's own samples, slow to sample), cached in SCRATCH."""
    path = SCRATCH / ("windows-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items())) + ".npz")
    if not path.is_file():
        w = data.windows(str(MODEL), None, seq_len=256, **kw)
        SCRATCH.mkdir(parents=True, exist_ok=True)
        np.savez(path, ids=w.ids, score_from=w.score_from, starts=w.starts, name=np.array(w.name))
    with np.load(path) as z:
        return data.Windows(z["ids"], z["score_from"], z["starts"], str(z["name"]))


def load_fixes(layers, fit_w, path):
    """Today's fixes as dense float64 tensors {layer: (w_a, w_p, b, w_in, b_in)}, fitted once and cached in `path`."""
    if not Path(path).is_file():
        fits = compensation.fit(graph.load(str(MODEL)), fit_w, set(layers), kind="full", options=runtime.Options(threads=1, inter_threads=1))
        d, out = fits[layers[0]].fix.w_a.shape[0], {}
        for l in layers:
            f = fits[l].fix
            wp = np.zeros((d, d)) if f.w_p is None else np.eye(d) * f.w_p if np.isscalar(f.w_p) else f.w_p
            out.update({f"w_a{l}": f.w_a, f"w_p{l}": wp, f"b{l}": f.b, f"w_in{l}": f.w_in, f"b_in{l}": f.b_in})
        np.savez(path, **out)
    z = np.load(path)
    return {l: tuple(torch.from_numpy(z[f"{k}{l}"]).to(F64) for k in FIELDS) for l in layers}


def collect(model, layers, ids, batch=4):
    """Per layer: x (resid_pre), A (attn_out), M (mlp_out), float32 [windows * (T-1), d], token 0 left out."""
    got, hooks = {l: {"x": [], "A": [], "M": []} for l in layers}, []
    for l in layers:
        blk = model.model.layers[l]
        hooks.append(blk.register_forward_pre_hook(lambda m, a, k, l=l: got[l]["x"].append((a[0] if a else k["hidden_states"])[:, 1:].flatten(0, 1).clone()), with_kwargs=True))
        hooks.append(blk.self_attn.register_forward_hook(lambda m, a, o, l=l: got[l]["A"].append(o[0][:, 1:].flatten(0, 1).clone())))
        hooks.append(blk.mlp.register_forward_hook(lambda m, a, o, l=l: got[l]["M"].append(o[:, 1:].flatten(0, 1).clone())))
    with torch.inference_mode():
        for i in range(0, len(ids), batch):
            model(torch.from_numpy(ids[i : i + batch]), use_cache=False)
    for h in hooks:
        h.remove()
    return {l: {k: torch.cat(v) for k, v in g.items()} for l, g in got.items()}


def branches(blk, fix, x, A):
    """(P, today's y'), float32 like the deployed graph: P = mlp(ln2(x) (I + w_in) + b_in)."""
    w_a, w_p, b, w_in, b_in = (t.float() for t in fix)
    P = blk.mlp(blk.post_attention_layernorm(x) @ (torch.eye(x.shape[-1]) + w_in) + b_in)
    return P, x + A + A @ w_a + P + P @ w_p + b


def ridge(G0, c0, G1, c1, t1t1):
    """Ridge solution of (G0 + G1) s = c0 + c1 with the strength (times diag G) whose fold-0 fit leaves least on fold 1."""
    def solve(G, c, lam):
        return torch.linalg.solve(G + lam * torch.diag(torch.diag(G).clamp_min(1e-30)), c)
    errs = [(t1t1 - 2 * (s * c1).sum() + (s * (G1 @ s)).sum()).item() for s in (solve(G0, c0, lam) for lam in RIDGES)]
    return solve(G0 + G1, c0 + c1, RIDGES[int(np.argmin(errs))])


def ls(X, T, fold):
    """Ridge least squares of T [n] or [n, k] on X [n, m], ridge chosen on the held-out fold (fold: bool [n])."""
    X0, X1, T0, T1 = X[~fold], X[fold], T[~fold], T[fold]
    return ridge(X0.T @ X0, X0.T @ T0, X1.T @ X1, X1.T @ T1, (T1 * T1).sum())


def fit_correction(A, P, R, fold, rank, rounds=3):
    """Greedy rank-1 ALS with deflation: U [d, rank], V [d, rank] and the seconds after each component."""
    R, U, V, secs, start = R.clone(), [], [], [], time.perf_counter()
    v0 = torch.linalg.eigh(P.T @ P)[1][:, -1]
    for _ in range(rank):
        w, v = torch.linalg.eigh(R.T @ R)[1][:, -1], v0.clone()
        for _ in range(rounds):
            t = R @ w
            u = ls(A * (P @ v)[:, None], t, fold)
            v = ls(P * (A @ u)[:, None], t, fold)
            s = (P @ v).pow(2).mean().sqrt()
            v, u = v / s, u * s
            h = (A @ u) * (P @ v)
            g = R.T @ h
            w = g / g.norm()
        u = u * (h @ (R @ w)) / (h @ h)  # the scale of the component along w
        R -= torch.outer((A @ u) * (P @ v), w)
        U.append(u), V.append(v), secs.append(time.perf_counter() - start)
    return torch.stack(U, 1), torch.stack(V, 1), secs


def refit_w(A, P, R, U, V, fold):
    """W [r, d]: the joint ridge least squares of R on the features (A U) * (P V)."""
    return ls((A @ U) * (P @ V), R, fold)


def energy_removed(R, corr):
    return 1 - ((R - corr) ** 2).sum().item() / (R ** 2).sum().item()


def replace_layers(model, fixes, corrs, state):
    """Each chosen decoder layer computes its compensated parallel block (+ the correction of state['rank'])
    when state['mode'] is not 'orig'; the stream is the model's own."""
    for l, fix in fixes.items():
        blk = model.model.layers[l]
        original = blk.forward

        def forward(hidden_states, *args, blk=blk, fix=fix, l=l, original=original, **kw):
            if state["mode"] == "orig":
                return original(hidden_states, *args, **kw)
            kw.pop("past_key_values", None), kw.pop("past_key_value", None)
            A, _ = blk.self_attn(hidden_states=blk.input_layernorm(hidden_states), past_key_values=None, **kw)
            P, y = branches(blk, fix, hidden_states, A)
            if state["mode"] == "corr":
                U, V, W = corrs[state["rank"]][l]
                y = y + ((A @ U) * (P @ V)) @ W
            return y

        blk.forward = forward


def write_graph(layers, fixes, folder) -> Path:
    """SmolLM2's graph with `fixes` {layer: tuple in FIELDS' order} folded into `layers` by surgery's own rewrite, written to `folder`."""
    from surgery.job import rewrite
    f64 = {l: Fix(**{k: np.asarray(v, np.float64) for k, v in zip(FIELDS, fixes[l])}) for l in layers}
    return graph.write(rewrite(graph.load(str(MODEL)), layers, fixes=f64).model, folder, like=str(MODEL))


def onnx_check(model, layers, fixes, ids, state):
    """Max |logits| difference, torch (today's fix) vs surgery's rewritten ONNX graph, on `ids`."""
    out = write_graph(layers, fixes, SCRATCH / "today")
    sess = runtime.session(out, runtime.Options(threads=1, inter_threads=1))
    ref = sess.run(["logits"], runtime.feeds(sess, ids))[0]
    state["mode"] = "today"
    with torch.inference_mode():
        mine = model(torch.from_numpy(ids), use_cache=False).logits.numpy()
    return float(np.abs(ref - mine).max()), float(np.abs(ref).max())


def evaluate(model, ids, modes, state, batch=2):
    """Per mode: per-window mean KL(orig || mode) and top-1 agreement over all positions but the last."""
    kl, top = {m: [] for m in modes}, {m: [] for m in modes}
    with torch.inference_mode():
        for i in range(0, len(ids), batch):
            x = torch.from_numpy(ids[i : i + batch])
            state["mode"] = "orig"
            lo = torch.log_softmax(model(x, use_cache=False).logits[:, :-1].double(), -1)
            for m in modes:
                state.update(mode="today" if m == "today" else "corr", rank=m)
                ln = torch.log_softmax(model(x, use_cache=False).logits[:, :-1].double(), -1)
                kl[m] += (lo.exp() * (lo - ln)).sum(-1).mean(-1).tolist()
                top[m] += (lo.argmax(-1) == ln.argmax(-1)).double().mean(-1).tolist()
    return {m: np.array(v) for m, v in kl.items()}, {m: np.array(v) for m, v in top.items()}


def boot(v, n=10000, seed=0):
    means = v[np.random.default_rng(seed).integers(0, len(v), (n, len(v)))].mean(1)
    return f"{v.mean():.4f} [{np.percentile(means, 2.5):.4f}, {np.percentile(means, 97.5):.4f}]"


def block_macs(c, T=256):
    """Multiply-adds per token of one block: weight matmuls, plus attention scores and values at mean context T / 2."""
    d, hd, nq, nk, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    return d * hd * (2 * nq + 2 * nk) + 3 * d * f, 2 * nq * hd * T / 2


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", default="4,8,16", help="ranks to fit and evaluate, comma separated")
    ap.add_argument("--layers", default="12,15,21,24,25,26,27,29")
    ap.add_argument("--fixes", default=str(SCRATCH / "fixes.npz"), help="today's fixes, cached (fitted when missing)")
    ap.add_argument("--eval-windows", type=int, default=32)
    args = ap.parse_args()
    ranks, layers = sorted(int(r) for r in args.rank.split(",")), [int(l) for l in args.layers.split(",")]
    SCRATCH.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    cal = windows(max_windows=80, part="calibration")
    fit_w, sel_w = data.deal(cal, [64, 16], ["fit", "selection"])
    ev = windows(max_windows=args.eval_windows, part="evaluation")
    fixes = load_fixes(layers, fit_w, args.fixes)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(HF), dtype=torch.float32).eval()
    stream = collect(model, layers, np.concatenate([fit_w.ids, sel_w.ids]))
    n_fit = len(fit_w) * (fit_w.seq_len - 1)
    fold = torch.from_numpy(np.repeat(np.arange(len(fit_w)) % 2 == 1, fit_w.seq_len - 1))
    print(f"collected {n_fit} fit + {len(sel_w) * (sel_w.seq_len - 1)} selection tokens per layer ({time.perf_counter() - clock:.0f} s)")
    corrs, secs, removed = {r: {} for r in ranks}, {r: 0.0 for r in ranks}, {r: [] for r in ranks}
    print("| layer | defect removed by today's fix (fit / held-out) | " + " | ".join(f"r={r}: held-out R removed, s" for r in ranks) + " |")
    for l in layers:
        blk, g = model.model.layers[l], stream.pop(l)
        with torch.inference_mode():
            P, y_fix = branches(blk, fixes[l], g["x"], g["A"])
            P0 = blk.mlp(blk.post_attention_layernorm(g["x"]))
        y = g["x"] + g["A"] + g["M"]
        R = (y.double() - y_fix.double())
        D0 = (y.double() - (g["x"] + g["A"] + P0).double())
        check = [energy_removed(D0[s], D0[s] - R[s]) for s in (slice(0, n_fit), slice(n_fit, None))]
        A, P = g["A"].double(), P.double()
        fa, fp, fr, sa, sp, sr = A[:n_fit], P[:n_fit], R[:n_fit], A[n_fit:], P[n_fit:], R[n_fit:]
        U, V, s = fit_correction(fa, fp, fr, fold, max(ranks))
        cells = []
        for r in ranks:
            t = time.perf_counter()
            W = refit_w(fa, fp, fr, U[:, :r], V[:, :r], fold)
            secs[r] += s[r - 1] + time.perf_counter() - t
            removed[r].append(energy_removed(sr, ((sa @ U[:, :r]) * (sp @ V[:, :r])) @ W))
            corrs[r][l] = (U[:, :r].float(), V[:, :r].float(), W.float())
            cells.append(f"{removed[r][-1]:.3f}, {s[r - 1]:.0f}")
        print(f"| {l} | {check[0]:.3f} / {check[1]:.3f} | " + " | ".join(cells) + " |", flush=True)
        del g, A, P, R, D0, fa, fp, fr, sa, sp, sr
    state = {"mode": "orig", "rank": None}
    replace_layers(model, {l: fixes[l] for l in layers}, corrs, state)
    diff, scale = onnx_check(model, layers, fixes, ev.ids[:2], state)
    print(f"ONNX check (2 evaluation windows): max |logits torch - onnx| = {diff:.2e} (max |logit| {scale:.1f})")
    t = time.perf_counter()
    kl, top = evaluate(model, ev.ids, ["today"] + ranks, state)
    print(f"evaluation: {len(ev)} windows, {(2 + len(ranks))} forward passes each ({time.perf_counter() - t:.0f} s)")
    smp = ev.sampled
    weights, attn = block_macs(model.config)
    d, rows = model.config.hidden_size, []
    for m in ["today"] + ranks:
        extra = 0 if m == "today" else 3 * d * m + m + d
        rows.append(f"| {'today' if m == 'today' else f'today + r={m}'} | {'-' if m == 'today' else f'{secs[m]:.0f}'} | "
                    f"{extra / weights:.2%} ({extra / (weights + attn):.2%}) | {'-' if m == 'today' else f'{np.mean(removed[m]):.3f}'} | "
                    f"{boot(kl[m])} | {top[m].mean():.4f} | {kl[m][~smp].mean():.4f} / {kl[m][smp].mean():.4f} |")
    print(f"\n{len(layers)} blocks {layers}; {len(ev)} evaluation windows ({smp.sum()} sampled); total {time.perf_counter() - clock:.0f} s\n")
    print("| fix | fit s (all layers) | FLOPs / block (with attn core @256) | held-out R removed (mean) | KL [95 % CI] | top-1 | KL text / sampled |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    best = min(ranks, key=lambda r: kl[r].mean())
    print(f"\nbest rank {best}: KL {kl[best].mean() / kl['today'].mean() - 1:+.1%} vs today's fix at {(3 * d * best + best + d) / weights:.2%} of a block's weight FLOPs")


if __name__ == "__main__":
    main()
