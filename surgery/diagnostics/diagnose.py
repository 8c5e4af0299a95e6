"""diagnose(): the paper's diagnostics of one exported model, from ONNX graphs on ONNX Runtime.

Scores (deficit, diversity, defect, gate, critical points, prefix sensitivity) and the compensation fit behind
C_l^comp stream over the calibration windows; losses (single-layer parallel and compensated dNLL and KL, the
ablation protocol) use the disjoint evaluation windows. Nothing holds more than one window's activations (the
fit: one window's, and each layer's normal equations).

Structure: `diagnose` opens the worker pool and `_diagnose` runs the steps in order, timing each:
`_scores` (the probe's one pass: deficit, diversity, C_l / C_l^stream and alpha, then `_critical` from
its seeds), the compensation fit, `_prefix`, and `_losses` (the switchboard's runs, `switch_losses`); then
`_defect` and `_ablation` turn the runs into their sections and a `Diagnosis` holds them all (`to_json()`:
report.json). `ProbeWindows` and `LossWindows` are the per-window sessions, here or on Ray actors.

With `checkpoints`, each step's result (the fit's units, each evaluation window's loss runs) is kept in a work
folder beside the report and a rerun of the same diagnose resumes from it (surgery.files.checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from pathlib import Path

import numpy as np

from surgery import compensation
from surgery.analysis import field, probe, resumable, switchboard
from surgery.analysis.defect import DefectStats
from surgery.analysis.switchboard import Switch
from surgery.compensation.equations import fixes as fixes_of
from surgery.compensation.fitting import FitSettings
from surgery.diagnostics import critical as crit
from surgery.diagnostics import prefix, stats
from surgery.diagnostics.geometry import unit
from surgery.diagnostics.rank import spearman
from surgery.diagnostics.sections import deficit, diversity
from surgery.engine import cluster, runtime
from surgery.engine.progress import Tell, silent
from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.files.checkpoint import Checkpoints, digest, model_digest, reached
from surgery.measure import scoring, statistics
from surgery.model.embedding import embedding_table
from surgery.model.subject import Subject
from surgery.passes import Ablation, Compensation
from surgery.passes.common import narrower_than_float32
from surgery.text import data
from surgery.text.data import DataSettings
from surgery.version import __version__

SECTIONS = ("deficit", "diversity", "defect", "gate", "critical", "prefix", "ablation")
PROBED = frozenset(("deficit", "diversity", "defect", "gate", "critical"))  # the sections that need the probe's pass
ABLATION_MODES = ("tangential", "radial", "remove")
SINK_MODES = ("tangential", "radial")  # also measured with position 0 keeping its branch output
BRANCHES = ("mlp", "attn")
PARALLEL = Switch("parallelize")  # the switchboard kind of the single-layer parallel runs
SINGLE = ("parallelize", "compensate")  # the passes whose kinds run one layer at a time only
WITH = {"compensate": (PARALLEL,)}  # a pass whose kinds need others on at the same layers: a compensated block is parallel


def compensated_kind(fixes: dict) -> Switch:
    """The switchboard kind of the single-layer compensated runs (with PARALLEL on at the same layer)."""
    return Switch("compensate", Compensation(fixes))


def ablation_kind(branch: str, mode: str, keep_sink: bool = False) -> Switch:
    """The switchboard kind of an ablation: the ablate pass on `branch` in `mode`."""
    return Switch("ablate", Ablation(branch, mode, keep_sink=keep_sink))


CHUNK = 8  # single-layer loss runs of a window per job (a job is a few seconds of SmolLM2)


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What diagnose() measured: one field per section of report.json (surgery/report/schema.json), each in
    its report.json form; a section that was not asked for is None.

    Attributes:
        model: path, n_layers, forms (one per block: sequential or parallel).
        windows: calibration and (when losses ran) evaluation windows: corpus, count, seq_len, tokens.
        seconds: wall time of each step that ran: probe, probe_setup (part of probe), critical, fit, prefix, losses.
        deficit: per layer, the alignment a_l of attn_out's and the mlp's tangential parts and the deficit 1 - a_l; their mean.
        diversity: pre / mid / post: diversity, effective_rank; d_attn, d_mlp, d_block.
        defect: c, c_stream, c_comp (+ notes), the single-layer parallel and compensated runs (dNLL, KL), spearman.
        gate: alpha, per layer.
        critical: seeds; per layer: r, converged, best_residual, counts, points.
        prefix: distances, sensitivity `[layer][distance]` of each block's resid_post.
        ablation: base_loss; all layers and per layer: dNLL, interval, KL, top-1.
    """

    model: dict  # path, n_layers, forms (one per block: sequential or parallel)
    windows: dict  # calibration and (when losses ran) evaluation: corpus, count, seq_len, tokens
    seconds: dict  # of each step that ran: probe, probe_setup (part of probe), critical, fit, prefix, losses
    deficit: dict | None = None  # alignment, deficit (per layer), mean
    diversity: dict | None = None  # pre / mid / post: diversity, effective_rank; d_attn, d_mlp, d_block
    defect: dict | None = None  # c, c_stream, c_comp (+ notes), single-layer parallel / compensated runs, spearman
    gate: dict | None = None  # alpha
    critical: dict | None = None  # seeds; per layer: r, converged, best_residual, counts, points
    prefix: dict | None = None  # distances, sensitivity [layer][distance]
    ablation: dict | None = None  # base_loss; all layers and per layer: dNLL, interval, KL, top-1

    def to_json(self) -> dict:
        """report.json's content: tool, model, windows, seconds, then the sections that ran in SECTIONS order."""
        head = {"tool": {"name": "surgery", "version": __version__}, "model": self.model, "windows": self.windows, "seconds": self.seconds}
        return head | {name: getattr(self, name) for name in SECTIONS if getattr(self, name) is not None}


@dataclasses.dataclass(frozen=True)
class DiagnoseSettings:
    """What diagnose measures and on which windows: the command's Measure and Data options, read once.

    Attributes:
        data: where the windows come from (`--data`, `--seq-len`, `--tokenizer`).
        windows: calibration windows, for the scores and the fit (`--windows`).
        eval_windows: evaluation windows, for the losses (`--eval-windows`).
        only: the sections to run, of SECTIONS (`--only`).
        critical_seeds: data seeds of each layer's critical-point search (at least 1).
        seed: of the prefix sensitivity's random draws.
    """

    data: DataSettings = DataSettings()
    windows: int = 4
    eval_windows: int = 4
    only: tuple[str, ...] = SECTIONS
    critical_seeds: int = 4
    seed: int = 0


def diagnose(model_path: str | Path, settings: DiagnoseSettings = DiagnoseSettings(), resources: cluster.Resources = cluster.Resources(),
             progress: Tell | None = None, checkpoints: str | Path | None = None, restart: bool = False) -> Diagnosis:
    """Run the selected diagnostics and return them as a Diagnosis (`to_json()`: the report, see surgery/report/schema.json).

    Scores and the compensation fit stream over the calibration windows; losses use the disjoint evaluation windows. With workers / ray the numbers
    are those of the in-process run, which runs two jobs (windows, chunks of loss runs) at a time when ORT picks the threads (cluster.concurrency).

    Args:
        model_path: the exported model: an .onnx file, or a folder holding one (and its tokenizer.json).
        settings: the sections, the windows and the seeds (DiagnoseSettings).
        resources: ONNX Runtime session options (with the analysis graphs' buffer plan off: runtime.analysis), and a Ray cluster to score the
            windows on (`workers`: a local one of that many CPUs; `ray`: the one at that address); neither: this process.
        progress: called as progress(stage, done, total).
        checkpoints: the report's folder: finished steps are kept in the work folder beside it, and a diagnose of the same model, windows and
            options resumes from them; removed when diagnose returns. None (default): nothing kept.
        restart: discard that work folder first.

    Returns:
        The Diagnosis: one field per report.json section that ran, with the model, the windows and each step's seconds.

    Raises:
        SurgeryError: an unknown section, fused blocks, critical_seeds below 1, a Ray cluster it cannot use, a work folder of another diagnose, or
            what `load` and `windows` raise.
    """
    options = runtime.analysis(resources.options)
    with resources.pool(concurrent=cluster.concurrency(options)) as pool:
        return _diagnose(model_path, settings, options, pool, progress or silent, checkpoints, restart)


def _diagnose(model_path: str | Path, settings: DiagnoseSettings, options: runtime.Options = runtime.Options(), pool: cluster.Pool = cluster.Pool(),
              tell: Tell = silent, checkpoints: str | Path | None = None, restart: bool = False) -> Diagnosis:
    """The steps in order, each timed: the probe's scores (and critical points), the compensation fit, prefix
    sensitivity, the loss runs; then the sections built from them."""
    only, critical_seeds, seed, seq_len = settings.only, settings.critical_seeds, settings.seed, settings.data.seq_len
    unknown = set(only) - set(SECTIONS)
    if unknown:
        raise SurgeryError(f"unknown diagnostic {', '.join(sorted(unknown))}; choose from {','.join(SECTIONS)}")
    model = Subject.load(model_path)  # read once: every step below takes it (the windows' samples too)
    blocks = model.blocks
    if any(b.fused for b in blocks):
        raise SurgeryError(f"{model_path} has fused blocks, whose attn_out and mlp_out are one MatMul; diagnose the model before `--fuse`")
    n = len(blocks)
    cal = settings.data.windows(model, settings.windows, "calibration", tell)
    about = {"path": str(graph.resolve(model_path)), "n_layers": n, "forms": [b.form for b in blocks]}
    read_windows = {"calibration": cal.describe()}
    seconds: dict[str, float] = {}
    ev = settings.data.windows(model, settings.eval_windows, "evaluation", tell) if "defect" in only or "ablation" in only else None
    work = Checkpoints.off()
    if checkpoints is not None:
        work = Checkpoints.open(checkpoints, {"model": model_digest(model_path, model.model),
                                              "calibration windows": digest(cal.ids), "evaluation windows": None if ev is None else digest(ev.ids),
                                              "only": sorted(only), "critical_seeds": critical_seeds, "seed": seed,
                                              "device": runtime.providers(options.device)[0]}, restart=restart)
    with work:  # its lock released however diagnose ends
        if (scores := work.load("scores")) is None:
            scores = _scores(model, blocks, cal, only, critical_seeds, options, tell, pool, seconds) if set(only) & PROBED else {}
            work.save("scores", scores)
        fits: dict = {}
        if "defect" in only:
            with _timed(seconds, "fit"):
                fits = compensation.fit(model, cal, settings=FitSettings(memory=None), options=options, pool=pool,
                                        progress=lambda d, t: tell("compensation fit", d, t), work=work.scope("fit"))
        sensitivity = None
        if "prefix" in only and (sensitivity := work.load("prefix")) is None:
            with _timed(seconds, "prefix"):
                sensitivity = _prefix(model, cal, seq_len, options, np.random.default_rng(seed), tell)
            work.save("prefix", sensitivity)
        defect = ablation = None
        if ev is not None:
            with _timed(seconds, "losses"):
                read_windows["evaluation"] = ev.describe()
                losses = _losses(model, blocks, ev, only, fits, options, tell, pool, work.scope("losses"))
                defect = _defect(scores["defect"], fits, losses, n) if "defect" in only else None
                ablation = _ablation(losses, n) if "ablation" in only else None
        work.finish()
    return Diagnosis(model=about, windows=read_windows, seconds=seconds, deficit=scores.get("deficit"), diversity=scores.get("diversity"),
                     defect=defect, gate=scores.get("gate"), critical=scores.get("critical"), prefix=sensitivity, ablation=ablation)


@contextlib.contextmanager
def _timed(seconds: dict[str, float], step: str):
    """Record the wall time of the `with` body as seconds[step] (when it finishes)."""
    start = time.perf_counter()
    yield
    seconds[step] = time.perf_counter() - start


def _scores(model, blocks, cal: data.Windows, only, critical_seeds: int, options, tell, pool: cluster.Pool, seconds: dict) -> dict:
    """The sections of the probe's one pass over the calibration windows: deficit, diversity, defect (C_l and
    C_l^stream only; the fit and the runs add the rest), gate, and critical (from the pass's seeds)."""
    start = time.perf_counter()
    twin = bool(set(only) & {"defect", "gate"})
    probed = _stream_probe(probe.probe(model, twin=twin), cal, options, len(blocks), tell, pool)
    seconds["probe"] = time.perf_counter() - start
    seconds["probe_setup"] = probed["ready"] - start  # of which: the graph and its session(s)
    sections = {}
    if "deficit" in only:
        sections["deficit"] = deficit(probed)
    if "diversity" in only:
        sections["diversity"] = diversity(probed["diversity"], blocks)
    if "defect" in only or "gate" in only:
        result = probed["defect"].result()
        if "defect" in only:
            sections["defect"] = {"c": result["c"], "c_stream": result["c_stream"]}
        if "gate" in only:
            sections["gate"] = {"alpha": result["alpha"]}
    if "critical" in only:
        with _timed(seconds, "critical"):
            sections["critical"] = _critical(model.model, blocks, probed, critical_seeds, options, tell)
    return sections


def _prefix(model, cal: data.Windows, seq_len: int, options, rng: np.random.Generator, tell) -> dict:
    """Prefix sensitivity S_l(d) of each block's resid_post, averaged over the calibration windows. Its session
    (and its weights) is gone when this returns: not held beside the loss runs' session."""
    p = probe.probe(model, tensors=("resid_post",), twin=False)
    sess = runtime.session(p.model, options)
    dists = prefix.distances(seq_len)
    names = [o["resid_post"] for o in p.outputs]
    curves = np.zeros((len(names), len(dists)))
    for i in range(len(cal)):
        curves += prefix.sensitivity(sess, names, cal.ids[i : i + 1], dists, runtime.vocab_size(sess), rng)
        tell("prefix sensitivity", i + 1, len(cal))
    return {"distances": dists, "sensitivity": (curves / len(cal)).tolist()}


def _losses(model, blocks, ev: data.Windows, only, fits: dict, options, tell, pool: cluster.Pool, work: Checkpoints) -> dict:
    """The loss runs on the evaluation windows (switch_losses): each block alone parallel and compensated (for
    defect), each ablation per layer and at all layers, and the sink-keeping ablations at all layers (for ablation)."""
    sink_kinds = [ablation_kind(b, m, keep_sink=True) for b in BRANCHES for m in SINK_MODES] if "ablation" in only else []
    kinds = ([PARALLEL, compensated_kind(fixes_of(fits))] if "defect" in only else []) + (
        [ablation_kind(b, m) for b in BRANCHES for m in ABLATION_MODES] if "ablation" in only else []
    ) + sink_kinds
    return switch_losses(model, blocks, kinds, ev, options, tell, all_only=set(sink_kinds), pool=pool, fixes=fixes_of(fits), work=work)


def _defect(scores: dict, fits: dict, losses: dict, n: int) -> dict:
    """The defect section: C_l and C_l^stream (the probe's `scores`), C_l^comp from the fit (a note where no fix
    was fitted), each block's single-layer parallel and compensated runs, and each score's Spearman against them."""
    fixes = fixes_of(fits)
    d = dict(scores)
    d["c_comp"] = [fits[l].c_comp if l in fixes else None for l in range(n)]
    d["c_comp_note"] = {str(l): f.note or "no fix" for l, f in sorted(fits.items()) if l not in fixes}
    for name, kind in (("parallel", PARALLEL), ("compensated", compensated_kind(fixes))):
        d.update({
            f"dnll_{name}": [losses[kind][l] for l in range(n)],
            f"dnll_{name}_interval": [losses["interval"][kind][l] for l in range(n)],
            f"kl_{name}": [losses["kl"][kind][l] for l in range(n)],  # mean token KL(original || this layer rewritten), nats
            f"kl_{name}_interval": [losses["kl_interval"][kind][l] for l in range(n)],
            f"top1_{name}": [losses["top1"][kind][l] for l in range(n)],
        })
    d["base_loss"] = losses["base"]
    # C_l and C_l^stream predict the plain parallel block's loss, C_l^comp the compensated one's
    truth = {"c": "parallel", "c_stream": "parallel", "c_comp": "compensated"}
    d["spearman"] = {k: spearman(d[k], d[f"dnll_{v}"]) for k, v in truth.items()}
    d["spearman_kl"] = {k: spearman(d[k], d[f"kl_{v}"]) for k, v in truth.items()}
    return d


def _ablation(losses: dict, n: int) -> dict:
    """The ablation section: each branch's mlp / attn edits at all layers at once and at each layer alone (dNLL,
    its interval, mean token KL vs the original, top-1 agreement), and the sink-keeping edits at all layers."""
    intervals, kl, top1 = losses["interval"], losses["kl"], losses["top1"]

    def table(source, modes=ABLATION_MODES, keep_sink: bool = False, per_layer: bool = False) -> dict:
        """{branch: {mode: value at all layers, or the list over layers}} of one measure."""
        pick = (lambda runs: [runs[l] for l in range(n)]) if per_layer else (lambda runs: runs["all"])
        return {b: {m: pick(source[ablation_kind(b, m, keep_sink)]) for m in modes} for b in BRANCHES}

    return {
        "base_loss": losses["base"],
        "all_layers": table(losses),
        "per_layer": table(losses, per_layer=True),
        "all_layers_interval": table(intervals),
        "per_layer_interval": table(intervals, per_layer=True),
        # position 0 (the attention sink) keeps its branch output; all layers at once only
        "all_layers_keep_sink": table(losses, SINK_MODES, keep_sink=True),
        "all_layers_keep_sink_interval": table(intervals, SINK_MODES, keep_sink=True),
        # mean token KL vs the original and top-1 agreement of the same runs
        "all_layers_kl": table(kl),
        "all_layers_top1": table(top1),
        "per_layer_kl": table(kl, per_layer=True),
        "per_layer_top1": table(top1, per_layer=True),
    }


class ProbeWindows:
    """The probe graph's session, reducing one window at a time to per-layer numbers (here or on a Ray actor).

    ONNX Runtime reduces each block's tensors to per-layer sums in the graph (stats.py); only those, the
    Gram matrices (whose eigenvalues give the effective ranks here) and, from the first window, the mlp
    field's seeds leave the session."""

    def __init__(self, model, taps: list[dict[str, str]], seeds: list[str], options: runtime.Options):
        self.session, self.taps, self.seeds = runtime.session(model, options), taps, seeds

    def window(self, ids: np.ndarray, with_seeds: bool) -> dict:
        wanted = [name for names in self.taps for name in names.values()] + (self.seeds if with_seeds else [])
        out = dict(zip(wanted, self.session.run(wanted, runtime.feeds(self.session, ids))))
        tokens = ids.shape[1] - 1  # token 0 (the attention sink) left out
        grams = {(layer, k): out[names[k]][0] for layer, names in enumerate(self.taps) for k in names if k.startswith("gram.")}
        ranks = dict(zip(grams, stats.effective_rank(np.stack(list(grams.values())))))
        return {
            "tokens": tokens,
            "align": [float(out[names["align"]][0]) for names in self.taps],
            "diversity": [
                {tensor: (1 - stats.mean_pairwise_cosine(out[names[f"sum_u.{point}"]][0], tokens), float(ranks[(layer, f"gram.{point}")]))
                 for point, tensor in stats.POINTS.items() if f"gram.{point}" in names}
                for layer, names in enumerate(self.taps)
            ],
            "defect": [out[names["defect"]] if "defect" in names else None for names in self.taps],
            "norms": [out[names["field_norm"]][0] for names in self.taps],
            "seeds": [out[name][0, 1:] for name in self.seeds] if with_seeds else None,
        }


def _stream_probe(p: probe.Probe, windows: data.Windows, options, n: int, tell, workers: cluster.Pool = cluster.Pool()) -> dict:
    """One pass over the windows through the probe graph (spread over Ray actors when `workers` has them),
    the per-window numbers reduced here in window order."""
    taps = stats.add_to(p.model, p.outputs, windows.seq_len - 1, embedding_table(p.model)[1])
    seeds = [o.get("resid_mid", o["resid_pre"]) for o in p.outputs]  # the field's input: ln2 reads it
    make = functools.partial(ProbeWindows, taps=taps, seeds=seeds, options=workers.options(options))
    actors = workers.actors(p.model, make)
    result = {
        "ready": time.perf_counter(),
        "align_sum": np.zeros(n), "align_count": np.zeros(n), "diversity": [],
        "defect": DefectStats(n), "norms": [[] for _ in range(n)], "seeds": [None] * n,
    }
    jobs = [(windows.ids[i : i + 1], i == 0) for i in range(len(windows))]
    for i, w in enumerate(actors.map("window", jobs)):
        for layer in range(n):
            result["align_sum"][layer] += w["align"][layer]
            result["align_count"][layer] += w["tokens"]
            if w["defect"][layer] is not None:
                result["defect"].add(layer, w["defect"][layer])
            result["norms"][layer].append(w["norms"][layer])
        if w["seeds"] is not None:
            result["seeds"] = w["seeds"]
        result["diversity"].append(w["diversity"])
        tell("probe", i + 1, len(windows))
    return result


def _critical(model, blocks, stats, n_seeds: int, options, tell) -> dict:
    """Zeros of each layer's mlp field from n_seeds data seeds (tokens spread over the first calibration window)."""
    if n_seeds < 1:
        raise SurgeryError(f"--critical-seeds is {n_seeds}; the critical-point search needs at least 1 seed per layer")
    layers = []
    for block in blocks:
        sess = runtime.session(field.field(model, block), options)
        dtype = runtime.element_type(sess.get_inputs()[0]).numpy()

        def f(z, sess=sess):  # points as a batch of one-token sequences [N, 1, d_model]: faster than [1, N, d_model]
            return sess.run(None, {field.FIELD_IN: z[:, None].astype(dtype)})[0][:, 0]

        r = float(np.median(np.concatenate(stats["norms"][block.layer])))
        pool = stats["seeds"][block.layer]
        picks = np.linspace(0, len(pool) - 1, n_seeds).astype(int)
        # Jacobian steps of 1e-3 are at float16's rounding: eigenvalue extremes off by up to 50 %; 1e-2 keeps them within 2 %
        eps = 1e-2 if dtype == np.float16 else 1e-3
        search = crit.find_critical_points(f, unit(pool[picks].astype(np.float64)), r, eps=eps)
        layers.append(
            {
                "layer": block.layer,
                "r": r,
                "converged": search.converged,
                "best_residual": search.best_residual,
                "counts": search.counts(),
                "points": [
                    {"kind": p.kind, "residual": p.residual, "max_real": p.max_real, "min_real": p.min_real, "unstable_dims": p.unstable_dims}
                    for p in search.points
                ],
            }
        )
        tell("critical points", block.layer + 1, len(blocks))
    return {"seeds": n_seeds, "layers": layers}


def switch_losses(model, blocks, kinds, windows, options, tell, all_only=frozenset(), pool: cluster.Pool = cluster.Pool(),
                   fixes: dict | None = None, work: Checkpoints | None = None) -> dict:
    """Loss with every switch off, then with each kind on at each layer alone (and at all layers for edits;
    kinds in all_only at all layers only, kinds in SINGLE at each layer only): dNLL per kind and layer, and under
    "interval" its 95 % paired bootstrap [low, high] over the windows. A layer where a kind changes nothing (a parallel
    block; a compensated run without a fix in `fixes`) gets None.

    Window by window: the run with every switch off keeps each block's resid_post, and a run with a kind on at
    block l alone starts there from block l - 1's (blocks < l would compute what that run did). In float16, or
    where some block cannot be skipped (resumable.resumable gives None), every run is a whole forward pass.
    A window's runs are scored in chunks of CHUNK, `pool.parallel` at a time (in this process or on Ray
    actors), each from the unchanged run's kept tensors; the parts are joined here in window order. Each window's
    scores are a checkpoint unit of `work`.
    """
    n, fixes = len(blocks), fixes or {}
    lazy = not narrower_than_float32(Subject.of(model).stream)  # If boundaries round float16 on CPU
    board = switchboard.switchboard(model, kinds, lazy=lazy)
    resume = resumable.resumable(board, blocks) if lazy else None
    jobs = [(kind, layer) for kind in kinds if kind not in all_only for layer in range(n)]
    jobs += [(kind, "all") for kind in kinds if kind.name not in SINGLE]
    runs = [job for job in jobs if not _unchanged(job, blocks, fixes)]
    chunks = [runs[i : i + CHUNK] for i in range(0, len(runs), CHUNK)]
    cut = dataclasses.replace(resume, model=None) if resume else None  # the graph goes to the actors once, as their model
    make = functools.partial(LossWindows, kinds=kinds, n_layers=n, resume=cut, options=pool.options(options))
    actors = pool.actors(board if resume is None else resume.model, make)
    parts: dict = {run: [] for run in [("base", None), *runs]}
    work = work or Checkpoints.off()
    for i in range(len(windows)):
        if (kept_scores := work.load(f"window-{i}")) is None:  # the window's scores, base first, then runs in order
            window = windows.take([i])
            [(base, kept, reference)] = actors.map("base", [(window,)])
            kept_scores = [base]
            for done, (chunk, scored) in enumerate(zip(chunks, actors.map("runs", [(window, chunk, kept, reference) for chunk in chunks])), 1):
                kept_scores.extend(scored)
                tell("losses", i * len(chunks) + done, len(windows) * len(chunks))
            work.save(f"window-{i}", kept_scores)
            reached(f"diagnose losses window {i}")
        for run, part in zip([("base", None), *runs], kept_scores):
            parts[run].append(part)
    base = statistics.joined(parts[("base", None)])
    measures = ("interval", "kl", "kl_interval", "top1")
    result: dict = {"base": base.loss, **{m: {kind: {} for kind in kinds} for m in measures}, **{kind: {} for kind in kinds}}
    for kind, layer in jobs:
        if _unchanged((kind, layer), blocks, fixes):
            for table in (result, *(result[m] for m in measures)):
                table[kind][layer] = None  # nothing to measure
            continue
        p = statistics.joined(parts[(kind, layer)])
        d, kl = statistics.delta(base, p), statistics.divergence(p)
        result[kind][layer] = p.loss - base.loss
        result["interval"][kind][layer] = [d.low, d.high]
        result["kl"][kind][layer], result["kl_interval"][kind][layer], result["top1"][kind][layer] = kl.kl, [kl.low, kl.high], kl.top1
    return result


class LossWindows:
    """The switchboard's scoring session (here or on a Ray actor): a window's unchanged run, which keeps each block's resid_post, then runs of it with one
    (kind, layer) switched on, a single-layer run resuming at its block from what the unchanged run kept (when it can)."""

    def __init__(self, model, kinds, n_layers: int, resume: resumable.Resumable | None, options: runtime.Options):
        self.kinds, self.n, self.resume = kinds, n_layers, resume
        self.scorer = scoring.Scorer(model, options, keep=resume.resid_post if resume else (), compare=True)

    def base(self, window: data.Windows) -> tuple[statistics.Perplexity, dict[str, np.ndarray], list[scoring.Reference]]:
        """The unchanged run: its score, the tensors it kept, and its next-token distribution (for KL)."""
        kept: dict = {}
        reference: list = []
        return self.scorer(window, extra=self._extra(None, kept), kept=kept, record=reference), kept, reference

    def runs(self, window: data.Windows, runs: list[tuple], kept: dict[str, np.ndarray], reference) -> list[statistics.Perplexity]:
        return [self.scorer(window, extra=self._extra(run, kept), reference=reference) for run in runs]

    def _extra(self, run, kept) -> dict:
        kind, layer = run or (None, None)
        single = isinstance(layer, int)
        on = {} if run is None else {k: {layer} if single else set(range(self.n)) for k in (kind, *WITH.get(kind.name, ()))}
        extra = {switchboard.SWITCHES: switchboard.switches(self.kinds, self.n, on)}
        if self.resume is not None:  # a single-layer run starts at its block, the others at block 0
            extra |= self.resume.inputs(layer if single else 0, kept)
        return extra


def _unchanged(job, blocks, fixes: dict) -> bool:
    """Whether a single-layer run would be the unchanged model: a parallel block, or no fix to switch on."""
    kind, layer = job
    return kind.name in SINGLE and layer != "all" and (blocks[layer].is_parallel or (kind.name == "compensate" and layer not in fixes))

