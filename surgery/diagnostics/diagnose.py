"""diagnose(): the paper's diagnostics of one exported model, from ONNX graphs on ONNX Runtime.

Scores (deficit, diversity, defect, gate, critical points, prefix sensitivity) stream over the
calibration windows; losses (single-layer parallel dNLL, the ablation protocol) use the disjoint
evaluation windows. Nothing holds more than one window's activations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from surgery import __version__, data, evaluate, graph, runtime
from surgery.blocks import find_blocks
from surgery.diagnostics import critical as crit
from surgery.diagnostics import graphs, prefix
from surgery.diagnostics.defect import DefectStats, spearman
from surgery.diagnostics.geometry import alignment, effective_rank, mean_pairwise_cosine, unit
from surgery.errors import SurgeryError

SECTIONS = ("deficit", "diversity", "defect", "gate", "critical", "prefix", "ablation")
ABLATION_MODES = ("tangential", "radial", "remove")
SINK_MODES = ("tangential", "radial")  # also measured with position 0 keeping its branch output
Progress = Callable[[str, int, int], None]  # (stage, done, total)


def diagnose(
    model_path: str | Path,
    *,
    corpus: str | Path | None = None,
    seq_len: int = 256,
    windows: int = 4,
    eval_windows: int = 4,
    only: tuple[str, ...] = SECTIONS,
    critical_seeds: int = 4,
    tokenizer: str | Path | None = None,
    options: runtime.Options = runtime.Options(),
    progress: Progress | None = None,
    seed: int = 0,
) -> dict:
    """Run the selected diagnostics; return a JSON-ready report (see surgery/report.schema.json)."""
    unknown = set(only) - set(SECTIONS)
    if unknown:
        raise SurgeryError(f"unknown diagnostic {', '.join(sorted(unknown))}; choose from {','.join(SECTIONS)}")
    tell = progress or (lambda stage, done, total: None)
    model = graph.load(model_path)
    blocks = find_blocks(model, where=str(model_path))
    if any(b.fused for b in blocks):
        raise SurgeryError(f"{model_path} has fused blocks, whose attn_out and mlp_out are one MatMul; diagnose the model before `--fuse`")
    n = len(blocks)
    cal = data.windows(model_path, corpus, seq_len=seq_len, max_windows=windows, part="calibration", tokenizer=tokenizer)
    report: dict = {
        "tool": {"name": "surgery", "version": __version__},
        "model": {"path": str(graph.resolve(model_path)), "n_layers": n, "forms": [b.form for b in blocks]},
        "windows": {"calibration": _describe(cal)},
        "seconds": {},
    }
    rng = np.random.default_rng(seed)

    if set(only) & {"deficit", "diversity", "defect", "gate", "critical"}:
        start = time.perf_counter()
        twin = bool(set(only) & {"defect", "gate"})
        stats = _stream_probe(graphs.probe(model, twin=twin), cal, options, n, tell)
        report["seconds"]["probe"] = time.perf_counter() - start
        if "deficit" in only:
            a = [s / c for s, c in zip(stats["align_sum"], stats["align_count"])]
            report["deficit"] = {"alignment": a, "deficit": [1 - x for x in a], "mean": float(np.mean([1 - x for x in a]))}
        if "diversity" in only:
            report["diversity"] = _diversity(stats["diversity"], blocks)
        if "defect" in only or "gate" in only:
            result = stats["defect"].result()
            if "defect" in only:
                report["defect"] = {"c": result["c"], "c_stream": result["c_stream"]}
            if "gate" in only:
                report["gate"] = {"alpha": result["alpha"]}
        if "critical" in only:
            start = time.perf_counter()
            report["critical"] = _critical(model, blocks, stats, critical_seeds, options, tell)
            report["seconds"]["critical"] = time.perf_counter() - start

    if "prefix" in only:
        start = time.perf_counter()
        p = graphs.probe(model, tensors=("resid_post",), twin=False)
        sess = runtime.session(p.model, options)
        dists = prefix.distances(seq_len)
        names = [o["resid_post"] for o in p.outputs]
        curves = np.zeros((n, len(dists)))
        for i in range(len(cal)):
            curves += prefix.sensitivity(sess, names, cal.ids[i : i + 1], dists, runtime.vocab_size(sess), rng)
            tell("prefix sensitivity", i + 1, len(cal))
        report["prefix"] = {"distances": dists, "sensitivity": (curves / len(cal)).tolist()}
        report["seconds"]["prefix"] = time.perf_counter() - start

    if "defect" in only or "ablation" in only:
        start = time.perf_counter()
        ev = data.windows(model_path, corpus, seq_len=seq_len, max_windows=eval_windows, part="evaluation", tokenizer=tokenizer)
        report["windows"]["evaluation"] = _describe(ev)
        sink_kinds = [(b, m, graphs.KEEP_SINK) for b in ("mlp", "attn") for m in SINK_MODES] if "ablation" in only else []
        kinds = ([("parallel",)] if "defect" in only else []) + (
            [(b, m) for b in ("mlp", "attn") for m in ABLATION_MODES] if "ablation" in only else []
        ) + sink_kinds
        losses = _switch_losses(model, blocks, kinds, ev, options, tell, all_only=set(sink_kinds))
        intervals = losses["interval"]
        if "defect" in only:
            dnll = [losses[("parallel",)][l] for l in range(n)]
            report["defect"].update(
                {
                    "base_loss": losses["base"],
                    "dnll_parallel": dnll,
                    "dnll_parallel_interval": [intervals[("parallel",)][l] for l in range(n)],
                    "spearman": {k: spearman(report["defect"][k], dnll) for k in ("c", "c_stream")},
                }
            )
        if "ablation" in only:
            branches = ("mlp", "attn")
            report["ablation"] = {
                "base_loss": losses["base"],
                "all_layers": {b: {m: losses[(b, m)]["all"] for m in ABLATION_MODES} for b in branches},
                "per_layer": {b: {m: [losses[(b, m)][l] for l in range(n)] for m in ABLATION_MODES} for b in branches},
                "all_layers_interval": {b: {m: intervals[(b, m)]["all"] for m in ABLATION_MODES} for b in branches},
                "per_layer_interval": {b: {m: [intervals[(b, m)][l] for l in range(n)] for m in ABLATION_MODES} for b in branches},
                # position 0 (the attention sink) keeps its branch output; all layers at once only
                "all_layers_keep_sink": {b: {m: losses[(b, m, graphs.KEEP_SINK)]["all"] for m in SINK_MODES} for b in branches},
                "all_layers_keep_sink_interval": {b: {m: intervals[(b, m, graphs.KEEP_SINK)]["all"] for m in SINK_MODES} for b in branches},
            }
        report["seconds"]["losses"] = time.perf_counter() - start
    return report


def _stream_probe(p: graphs.Probe, windows: data.Windows, options, n: int, tell) -> dict:
    """One pass over the windows through the probe graph, keeping only running sums and small samples."""
    sess = runtime.session(p.model, options)
    names = [o.name for o in sess.get_outputs()]
    stats = {
        "align_sum": np.zeros(n), "align_count": np.zeros(n), "diversity": [],
        "defect": DefectStats(n), "norms": [[] for _ in range(n)], "seeds": [None] * n,
    }
    for i in range(len(windows)):
        out = dict(zip(names, sess.run(None, runtime.feeds(sess, windows.ids[i : i + 1]))))
        per_window = []
        for layer, o in enumerate(p.outputs):
            t = {k: out[v][0, 1:] for k, v in o.items()}  # [pos, d_model], token 0 (the attention sink) left out
            x, y = t["resid_pre"], t["resid_post"]
            cos = alignment(x, t["attn_out"], y)
            stats["align_sum"][layer] += cos.sum()
            stats["align_count"][layer] += len(cos)
            per_window.append({k: (1 - mean_pairwise_cosine(t[k]), effective_rank(t[k])) for k in ("resid_pre", "resid_mid", "resid_post") if k in t})
            if "mlp_out_on_pre" in t:
                stats["defect"].update(layer, t["mlp_out"], t["mlp_out_on_pre"], y)
            field_in = t["resid_mid"] if "resid_mid" in t else x
            stats["norms"][layer].append(np.linalg.norm(field_in.astype(np.float64), axis=-1))
            if stats["seeds"][layer] is None:
                stats["seeds"][layer] = field_in
        stats["diversity"].append(per_window)
        tell("probe", i + 1, len(windows))
    return stats


def _diversity(samples: list[list[dict]], blocks) -> dict:
    def mean(key, index, layer):
        values = [w[layer][key][index] for w in samples if key in w[layer]]
        return float(np.mean(values)) if values else None

    result = {}
    for point, key in (("pre", "resid_pre"), ("mid", "resid_mid"), ("post", "resid_post")):
        result[point] = {
            "diversity": [mean(key, 0, b.layer) for b in blocks],
            "effective_rank": [mean(key, 1, b.layer) for b in blocks],
        }
    pre, mid, post = (result[k]["diversity"] for k in ("pre", "mid", "post"))
    result["d_attn"] = [None if m is None else m - p for p, m in zip(pre, mid)]
    result["d_mlp"] = [None if m is None else q - m for m, q in zip(mid, post)]
    result["d_block"] = [q - p for p, q in zip(pre, post)]
    return result


def _critical(model, blocks, stats, n_seeds: int, options, tell) -> dict:
    layers = []
    for block in blocks:
        sess = runtime.session(graphs.field(model, block), options)
        dtype = np.float16 if "float16" in sess.get_inputs()[0].type else np.float32

        def f(z, sess=sess):
            return sess.run(None, {graphs.FIELD_IN: z[None].astype(dtype)})[0][0]

        r = float(np.median(np.concatenate(stats["norms"][block.layer])))
        pool = stats["seeds"][block.layer]
        picks = np.linspace(0, len(pool) - 1, n_seeds).astype(int)
        search = crit.find_critical_points(f, unit(pool[picks].astype(np.float64)), r)
        layers.append(
            {
                "layer": block.layer,
                "r": r,
                "counts": search.counts(),
                "points": [
                    {"kind": p.kind, "residual": p.residual, "max_real": p.max_real, "min_real": p.min_real, "unstable_dims": p.unstable_dims}
                    for p in search.points
                ],
            }
        )
        tell("critical points", block.layer + 1, len(blocks))
    return {"seeds": n_seeds, "layers": layers}


def _switch_losses(model, blocks, kinds, windows, options, tell, all_only=frozenset()) -> dict:
    """Loss with every switch off, then with each kind on at each layer alone (and at all layers for edits;
    kinds in all_only at all layers only): dNLL per kind and layer, and under "interval" its 95 % paired
    bootstrap [low, high] over the windows.

    Window by window: the run with every switch off keeps each block's resid_post, and a run with a kind on at
    block l alone starts there from block l - 1's (blocks < l compute what that run did). Where some block cannot
    be skipped (graphs.resumable gives None) every run is a whole forward pass.
    """
    n = len(blocks)
    board = graphs.switchboard(model, kinds)
    resume = graphs.resumable(board)
    scorer = evaluate.Scorer(board if resume is None else resume.model, options, keep=resume.resid_post if resume else ())
    jobs = [(kind, layer) for kind in kinds if kind not in all_only for layer in range(n)]
    jobs += [(kind, "all") for kind in kinds if kind != ("parallel",)]
    runs = [("base", None)] + [job for job in jobs if not _already_parallel(job, blocks)]
    parts: dict = {run: [] for run in runs}
    for i in range(len(windows)):
        window, kept = windows.take([i]), {}
        for done, (kind, layer) in enumerate(runs, 1):
            on = {} if kind == "base" else {kind: set(range(n)) if layer == "all" else {layer}}
            extra = {graphs.SWITCHES: graphs.switches(kinds, n, on)}
            if resume is not None:
                extra |= resume.inputs(layer if isinstance(layer, int) else 0, kept)
            parts[(kind, layer)].append(scorer(window, extra=extra, kept=kept if kind == "base" else None))
            tell("losses", i * len(runs) + done, len(windows) * len(runs))
    base = evaluate.joined(parts[("base", None)])
    result: dict = {"base": base.loss, "interval": {kind: {} for kind in kinds}, **{kind: {} for kind in kinds}}
    for kind, layer in jobs:
        if _already_parallel((kind, layer), blocks):
            result[kind][layer] = result["interval"][kind][layer] = None  # nothing to measure
            continue
        p = evaluate.joined(parts[(kind, layer)])
        d = evaluate.delta(base, p)
        result[kind][layer] = p.loss - base.loss
        result["interval"][kind][layer] = [d.low, d.high]
    return result


def _already_parallel(job, blocks) -> bool:
    kind, layer = job
    return kind == ("parallel",) and layer != "all" and blocks[layer].is_parallel


def _describe(w: data.Windows) -> dict:
    return {"corpus": w.name, "count": len(w), "seq_len": w.seq_len, "tokens": w.tokens}

