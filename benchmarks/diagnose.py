"""The diagnostics through a torch forward-hook implementation vs `surgery diagnose` on ONNX Runtime,
on the same calibration windows of SmolLM2-135M: agreement and wall time.

    python benchmarks/diagnose.py [--windows 4] [--seq-len 256] [--repeats 3]
    python benchmarks/diagnose.py --sections [--against OLD/report.json] [--workers N] [--save report.json]   # `surgery diagnose` with defaults, by section
    python benchmarks/diagnose.py --losses [--windows 1] [--rounds 2]   # the losses section, three ways interleaved
    python benchmarks/diagnose.py --critical [--critical-seeds 4] [--newton-layers 5,20,29]   # critical points per layer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from unittest import mock

import numpy as np
import torch
from common import smollm2, table
from threadpoolctl import threadpool_limits
from transformers import AutoModelForCausalLM

from surgery import cluster, data, graph, runtime
from surgery.analysis import field as field_graph
from surgery.analysis import probe as probe_graph
from surgery.analysis import resumable as resumable_graph
from surgery.blocks import find_blocks
from surgery.diagnostics import diagnose
from surgery.diagnostics.critical import tangent_basis
from surgery.diagnostics.diagnose import PARALLEL, ablation_kind, switch_losses
from surgery.diagnostics.geometry import alignment, effective_rank, mean_pairwise_cosine, tangential, unit
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


def losses_section(folder, windows: int, seq_len: int, rounds: int) -> None:
    """diagnose's losses section for two kinds (parallel and mlp tangential: 62 runs a window), interleaved
    rounds of three ways: every run a whole forward, single-layer runs resuming at their block (prefix reuse)
    one two-thread run at a time, and prefix reuse with two one-thread runs at a time (the default)."""
    model = graph.load(folder)
    blocks = find_blocks(model)
    ev = data.windows(folder, seq_len=seq_len, max_windows=windows, part="evaluation")
    kinds = [PARALLEL, ablation_kind("mlp", "tangential")]
    options = runtime.analysis(runtime.Options())
    ways = {"whole forwards, one two-thread run at a time": (1, True), "prefix reuse, one two-thread run at a time": (1, False),
            "prefix reuse, two one-thread runs at a time (default)": (2, False)}
    seconds: dict = {way: [] for way in ways}
    results = {}
    for _ in range(rounds):
        for way, (concurrent, whole) in ways.items():
            patch = mock.patch.object(resumable_graph, "resumable", lambda board, blocks: None) if whole else contextlib.nullcontext()
            with patch, cluster.pool(concurrent=concurrent) as pool:
                start = time.perf_counter()
                results[way] = switch_losses(model, blocks, kinds, ev, options, lambda *_: None, pool=pool)
                seconds[way].append(time.perf_counter() - start)
            print(f"{way}: {seconds[way][-1]:.1f} s", file=sys.stderr, flush=True)
    first = results[next(iter(ways))]
    rows = []
    for way in ways:
        r = results[way]
        diff = max(abs(r[k][l] - first[k][l]) for k in kinds for l in first[k] if first[k][l] is not None)
        rows.append({"losses run as": way, **{f"round {i + 1}": f"{t:.1f} s" for i, t in enumerate(seconds[way])},
                     "max abs diff of the dNLLs vs whole forwards": f"{diff:.1e}"})
    print(f"SmolLM2-135M, {windows} evaluation window(s) x {seq_len} tokens, kinds parallel + mlp tangential ({len(kinds) * len(blocks) + 2} runs a window)")
    print(table(rows, list(rows[0])))


def critical_rows(report: dict) -> list[dict]:
    """One row per layer of diagnose's critical points: converged seeds, best residual, kinds, spectrum range."""
    rows = []
    for layer in report["critical"]["layers"]:
        points = layer["points"]
        rows.append({
            "layer": layer["layer"],
            "converged": f"{layer['converged']} / {report['critical']['seeds']}",
            "best residual": f"{layer['best_residual']:.1e}",
            **{kind: layer["counts"][kind] for kind in ("attractor", "saddle", "repeller")},
            "eigenvalue real parts": f"{min(p['min_real'] for p in points):.0f} .. {max(p['max_real'] for p in points):.0f}" if points else "-",
        })
    return rows


def levenberg_marquardt(f, u: np.ndarray, r: float, normalized: bool, iterations: int = 30, tol: float = 1e-3) -> tuple[np.ndarray, int]:
    """LM on the tangent residual R(u) = P_u g(r u) (or P_u g / |g| when normalized) from unit u: forward-difference
    Jacobian in the tangent basis, damping mu * mean diag(J^T J), mu / 10 after a step that lowers |R|, x 10 after
    one that does not; retraction unit(u + Q s). Stops when |R| / |R(seed)| < tol. Returns u and the Jacobians used."""

    def residual(points):
        g = f(r * points).astype(np.float64)
        t = tangential(g, points)
        return t / np.linalg.norm(g, axis=-1, keepdims=True) if normalized else t

    value, mu = residual(u[None])[0], 1e-3
    start = np.linalg.norm(value)
    for used in range(1, iterations + 1):
        q = tangent_basis(u)
        jac = q.T @ ((residual(unit(u + 1e-3 * q.T)) - value) / 1e-3).T
        jtj, grad = jac.T @ jac, jac.T @ (q.T @ value)
        for _ in range(8):
            trial = unit(u + q @ np.linalg.solve(jtj + mu * np.trace(jtj) / len(jtj) * np.eye(len(jtj)), -grad))
            trial_value = residual(trial[None])[0]
            if np.linalg.norm(trial_value) < np.linalg.norm(value):
                u, value, mu = trial, trial_value, max(mu / 10, 1e-9)
                break
            mu *= 10
        if np.linalg.norm(value) < tol * start:
            break
    return u, used


def newton_rows(folder, report: dict, windows, layers: list[int], n_seeds: int) -> list[dict]:
    """LM from diagnose's data seeds (the first calibration window's resid_mid, spread over its tokens), on |F| and on
    |F| / |g|: where it ends, measured by both residuals and by how large the mlp output is there."""
    model = graph.load(folder)
    blocks = find_blocks(model)
    tapped = probe_graph.tap(model, [blocks[l].mlp_in for l in layers])
    sess = runtime.session(tapped)
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, runtime.feeds(sess, windows.ids[:1]))))
    rows = []
    for l in layers:
        field = runtime.session(field_graph.field(model, blocks[l]))

        def f(z, field=field):
            return field.run(None, {field_graph.FIELD_IN: z[:, None].astype(np.float32)})[0][:, 0]

        pool = out[blocks[l].mlp_in][0, 1:]
        seeds = unit(pool[np.linspace(0, len(pool) - 1, n_seeds).astype(int)].astype(np.float64))
        r = report["critical"]["layers"][l]["r"]
        g0 = f(r * seeds).astype(np.float64)
        scale, size = np.median(np.linalg.norm(tangential(g0, seeds), axis=-1)), np.median(np.linalg.norm(g0, axis=-1))
        for normalized in (False, True):
            start = time.perf_counter()
            ends = [levenberg_marquardt(f, s, r, normalized) for s in seeds]
            u = np.stack([e[0] for e in ends])
            g = f(r * u).astype(np.float64)
            rel = np.linalg.norm(tangential(g, u), axis=-1) / scale
            sine = np.linalg.norm(tangential(g, u), axis=-1) / np.linalg.norm(g, axis=-1)
            rows.append({  # F = P_u g, g = mlp(ln2(r u)); sine = norm(F) / norm(g)
                "layer": l,
                "LM on": "F / norm(g)" if normalized else "F",
                "Jacobians per seed": " ".join(str(e[1]) for e in ends),
                "norm(F) < 1e-3 median norm(F(seed))": f"{(rel < 1e-3).sum()} / {n_seeds}",
                "sine < 1e-3": f"{(sine < 1e-3).sum()} / {n_seeds}",
                "median sine": f"{np.median(sine):.1e}",
                "median norm(g) / median norm(g(seed))": f"{np.median(np.linalg.norm(g, axis=-1)) / size:.1e}",
                "seconds": f"{time.perf_counter() - start:.0f}",
            })
    return rows


def critical_section(folder, args) -> None:
    """diagnose's critical points per layer and the section time; with --newton-layers, LM from the same seeds."""
    windows = data.windows(folder, seq_len=args.seq_len, max_windows=args.windows, part="calibration")
    report = diagnose(folder, seq_len=args.seq_len, windows=args.windows, only=("critical",), critical_seeds=args.critical_seeds).to_json()
    rows = critical_rows(report)
    with_zero = sum(layer["converged"] > 0 for layer in report["critical"]["layers"])
    print(f"SmolLM2-135M, {len(windows)} calibration windows x {args.seq_len} tokens, {args.critical_seeds} data seeds per layer: "
          f"a converged zero in {with_zero} of {len(rows)} layers; critical section {report['seconds']['critical']:.1f} s "
          f"(probe pass before it {report['seconds']['probe']:.1f} s)")
    print(table(rows, list(rows[0])))
    if args.newton_layers:
        with threadpool_limits(1, user_api="blas"):  # as in critical.py: threaded OpenBLAS stalls on a busy 2-core machine
            rows = newton_rows(folder, report, windows, [int(x) for x in args.newton_layers.split(",")], args.critical_seeds)
        print("\nLevenberg-Marquardt from the same data seeds, at most 30 Jacobians each")
        print(table(rows, list(rows[0])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--losses", action="store_true", help="the losses section three ways, interleaved (give --windows 1)")
    parser.add_argument("--rounds", type=int, default=2, help="with --losses: interleaved rounds")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved ORT / torch runs of the scores (medians)")
    parser.add_argument("--critical", action="store_true", help="only the critical points per layer, with diagnose's defaults")
    parser.add_argument("--critical-seeds", type=int, default=4)
    parser.add_argument("--newton-layers", default="", help="with --critical: layers to run Levenberg-Marquardt on, e.g. 5,20,29")
    parser.add_argument("--sections", action="store_true", help="`surgery diagnose` with defaults, seconds by section")
    parser.add_argument("--against", help="with --sections: a report.json of the same model to compare every number with")
    parser.add_argument("--workers", type=int, help="with --sections: a local Ray cluster of this many CPUs")
    parser.add_argument("--save", help="with --sections: write the report as JSON here")
    args = parser.parse_args()
    folder = smollm2()
    if args.losses:
        losses_section(folder, args.windows, args.seq_len, args.rounds)
        return
    if args.critical:
        critical_section(folder, args)
        return
    if args.sections:
        sections(folder, args)
        return
    windows = data.windows(folder, seq_len=args.seq_len, max_windows=args.windows, part="calibration")

    src = resolve_source("smollm2-135m")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, attn_implementation="eager").eval()
    torch_setup = time.perf_counter() - start
    ort_pass, ort_setup, torch_pass = [], [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine
        # eval_windows only sizes the dNLL ground truth that "defect" also measures; it is not compared here.
        report = diagnose(folder, seq_len=args.seq_len, windows=args.windows, eval_windows=1, only=("deficit", "diversity", "defect", "gate")).to_json()
        ort_setup.append(report["seconds"]["probe_setup"])  # the probe graph, its statistics and session
        ort_pass.append(report["seconds"]["probe"] - report["seconds"]["probe_setup"])  # the one pass that gives every score below
        start = time.perf_counter()
        ref = torch_diagnostics(model, windows)
        torch_pass.append(time.perf_counter() - start)
    ort_s, torch_s, setup_s = (float(np.median(x)) for x in (ort_pass, torch_pass, ort_setup))
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
    print(f"\nwall time, scores for all 30 layers, median of {args.repeats} interleaved runs: the pass over the windows, "
          f"ORT probe {ort_s:.2f} s, torch hooks {torch_s:.2f} s (torch / ORT {torch_s / ort_s:.2f}x); set-up, ORT probe graph "
          f"and session {setup_s:.2f} s, torch from_pretrained {torch_setup:.2f} s (once); both together, torch / ORT "
          f"{(torch_s + torch_setup) / (ort_s + setup_s):.2f}x")


BEFORE = {"probe": 12.2, "critical": 155.2, "prefix": 21.2, "losses": 465.1, "total": 658.0}  # when issue 11 was filed (RESULTS.md)


def _leaves(x, path=""):
    """(path, number) of every number in a report."""
    if isinstance(x, dict):
        for key, value in x.items():
            yield from _leaves(value, f"{path}/{key}")
    elif isinstance(x, (list, tuple)):
        for i, value in enumerate(x):
            yield from _leaves(value, f"{path}/{i}")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, float(x)


def sections(folder, args) -> None:
    """`surgery diagnose` with its defaults, timed by section beside the section times of the --against report
    (or, without one, those of RESULTS.md when issue 11 was filed), and every number of each section beside that
    report's (critical points, when it comes from the earlier search: layers with a zero counted)."""
    start = time.perf_counter()
    report = diagnose(folder, workers=args.workers).to_json()
    total = time.perf_counter() - start
    if args.save:
        with open(args.save, "w") as f:
            json.dump(report, f)
    sec = report["seconds"]
    old = json.load(open(args.against)) if args.against else None
    before = old["seconds"] if old else BEFORE  # that report's own section times, or those in RESULTS.md
    label = f"seconds, {args.against}" if old else "seconds when issue 11 was filed"
    rows = [{"section": k, label: f"{before[k]:.1f}", "seconds now": f"{sec[k]:.1f}"} for k in ("probe", "critical", "prefix", "losses")]
    rows.append({"section": "total (load, windows, sections)", label: f"{before['total']:.1f}" if "total" in before else "", "seconds now": f"{total:.1f}"})
    print(f"`surgery diagnose` defaults on SmolLM2-135M, {torch.get_num_threads()} cores, workers {args.workers or 0}; "
          f"probe set-up (graph and session) {sec['probe_setup']:.1f} s of the probe")
    print(table(rows, list(rows[0])))
    rho = report["defect"]["spearman"]
    print(f"\nSpearman with the single-layer parallel dNLL (evaluation windows): C_l {rho['c']:.3f}, C_l^stream {rho['c_stream']:.3f} "
          "(more one-pass scores: benchmarks/RESULTS.md, \"One-pass predictors\")")
    if old:
        rows = []
        same_method = "converged" in old["critical"]["layers"][0]  # a report of this critical-point search
        for key in ("deficit", "diversity", "defect", "gate", "prefix", "ablation") + (("critical",) if same_method else ()):
            a, b = dict(_leaves(report[key])), dict(_leaves(old[key]))
            shared = sorted(a.keys() & b.keys())
            rel = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in shared)
            rows.append({"section": key, "numbers": len(shared), "only in one": len(a.keys() ^ b.keys()), "max rel diff": f"{rel:.1e}"})
        zeros = lambda r: sum(bool(layer["points"]) for layer in r["critical"]["layers"])  # noqa: E731
        if not same_method:
            rows.append({"section": "critical (layers with a zero)", "numbers": f"{zeros(old)} -> {zeros(report)}", "only in one": "", "max rel diff": "new method"})
        print(f"\nagainst {args.against}")
        print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
