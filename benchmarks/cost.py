"""What the main job and diagnose cost, as functions of the model's shape and the job's windows: FLOPs, bytes
moved, memory and seconds, from a few rates measured on this machine.

    python benchmarks/cost.py                                   # measure the rates, project 135M, 1.1B, 8B, 70B
    python benchmarks/cost.py --validate SHAPE:LAYERS:RUN ...   # predicted vs measured, one row per part of each run

RUN is the output folder of `surgery parallelize` (its selection.json) or of `surgery diagnose` (report.json),
with the `/usr/bin/time -v` log of the command beside it as RUN.time (wall time and peak RSS); SHAPE is a name
in SHAPES (synthetic-2048 is fixtures/big_decoder.py's) and LAYERS its number of blocks.

The model counts what the code does (surgery/compensation.py, select.py, diagnostics/diagnose.py):
- fit: each pass runs only its own blocks (from the stream the pass before handed on), so the forward passes of
  all passes together are one pass of every block, each block's mlp twice (the twin), no head, over the fit
  windows; per window and block the float32 products Z'Z (k = 2 d + 1: syrk, n k^2) and Z'delta (2 n k d) are
  added to float64 sums; per block the ridge choice (one symmetric eigendecomposition of k^2, two k^3 products)
  and one LU solve with d right-hand sides.
- selection: the switchboard scored on the selection windows once per trial and once for the baseline: every
  block, the head and the log-softmax; each compensated block's switch copies W_o and W_down (Where).
- evaluation: the original and the rewritten model on the evaluation windows; write: the weights once.
- diagnose: the probe (every block with the twin mlp, three Gram matrices d^2 per block and window, their
  eigenvalues on the host), the loss runs (per evaluation window: the baseline, then 7 switch kinds at each
  block alone, each run resuming at its block, and 10 all-layer runs), prefix sensitivity (a probe run per
  distance per window) and the critical points (per block: the field's fixed-point steps and, per zero found,
  a forward-difference Jacobian of d mlp evaluations and its d^2 nonsymmetric eigenvalues).

Rates are measured here, at the shapes that matter: ONNX Runtime's float32 MatMul (prefill of 256 tokens),
NumPy's float32 syrk/GEMM and float64 GEMM, symmetric and nonsymmetric eigendecompositions (time / k^3) and
memory bandwidth (a float64 add). The GPU projection assumes an H200-class device (stated in GPU below): the
forward passes run there, the fit's sums and solves stay on the host CPU as the code does today.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from common import ROOT, table

sys.path.insert(0, str(ROOT))

SHAPES = {  # d_model, heads, kv heads, d_mlp, vocab (config.json of each)
    "smollm2-135m": dict(d=576, heads=9, kv=3, mlp=1536, vocab=49152),
    "synthetic-2048": dict(d=2048, heads=32, kv=4, mlp=5632, vocab=32000),  # fixtures/big_decoder.py (TinyLlama-1.1B)
    "llama-3-8b": dict(d=4096, heads=32, kv=8, mlp=14336, vocab=128256),
    "llama-3-70b": dict(d=8192, heads=64, kv=8, mlp=28672, vocab=128256),
}
LAYERS = {"smollm2-135m": 30, "synthetic-2048": 22, "llama-3-8b": 32, "llama-3-70b": 80}
# An H200-class GPU, assumed: ORT's fp32 MatMuls at half of 67 TFLOP/s (no TF32), 4.8 TB/s HBM, 141 GB.
GPU = dict(name="H200-class (assumed)", flops=33e12, bandwidth=4.8e12, memory=141e9)


@dataclasses.dataclass(frozen=True)
class Job:
    """The main job's and diagnose's windows (their defaults) and how many selection trials ran."""

    tokens: int = 256
    fit_windows: int = 64
    selection_windows: int = 16
    eval_windows: int = 8
    trials: int | None = None  # None: one per block (every candidate tried)
    compensated: int | None = None  # blocks with a fix, whose switch the trials' graph holds (None: all)
    diag_windows: int = 4
    diag_eval_windows: int = 4
    zeros: int | None = None  # critical points found per block (None: one per seed, 4)
    fit_memory: int | None = None  # --fit-memory bytes (None: auto, a quarter of the memory available here now)


@dataclasses.dataclass(frozen=True)
class Rates:
    ort: float  # ONNX Runtime float32 MatMul, FLOP/s
    blas32: float  # NumPy float32 syrk and GEMM of the fit's shapes, FLOP/s
    blas64: float  # NumPy float64 GEMM, FLOP/s
    eigh: float  # seconds / k^3, symmetric (eigh)
    eig: float  # seconds / k^3, nonsymmetric (eigvals)
    bandwidth: float  # bytes/s of a float64 add (read two, write one)
    write: float  # bytes/s written to disk (the rewritten model)

    @classmethod
    def measure(cls) -> Rates:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        rng = np.random.default_rng(0)
        d, m, t = 1024, 2816, 256
        w = numpy_helper.from_array(rng.standard_normal((d, m)).astype(np.float32) / 32, "w")
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [t, m])], [w])
        sess = ort.InferenceSession(helper.make_model(g, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        x = rng.standard_normal((t, d)).astype(np.float32)
        ort_rate = 2 * t * d * m / _seconds(lambda: sess.run(None, {"x": x}), 20)
        k, n = 2 * 1024 + 1, 255
        z, delta = rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((n, 1024)).astype(np.float32)
        blas32 = (n * k * k + 2 * n * k * 1024) / _seconds(lambda: (z.T @ z, z.T @ delta), 10)
        a = rng.standard_normal((k, k))
        blas64 = 2 * k**3 / _seconds(lambda: a @ a, 3)
        sym = a @ a.T / k + np.eye(k)
        eigh = _seconds(lambda: np.linalg.eigh(sym), 2) / k**3
        small = rng.standard_normal((1024, 1024))
        eig = _seconds(lambda: np.linalg.eigvals(small), 2) / 1024**3
        big, other = np.zeros(1 << 24), np.ones(1 << 24)
        bandwidth = 3 * big.nbytes / _seconds(lambda: big.__iadd__(other), 10)
        return cls(ort_rate, blas32, blas64, eigh, eig, bandwidth, _write_rate())


def _seconds(f, repeats: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - start) / repeats


def _write_rate(nbytes: int = 512 << 20) -> float:
    import os
    import tempfile

    block = np.random.default_rng(0).bytes(64 << 20)
    with tempfile.NamedTemporaryFile(dir=ROOT / "out" if (ROOT / "out").is_dir() else None) as f:
        start = time.perf_counter()
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return nbytes / (time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class Shape:
    d: int
    heads: int
    kv: int
    mlp: int
    vocab: int
    layers: int

    @property
    def d_kv(self) -> int:
        return self.d // self.heads * self.kv

    def block_params(self) -> int:
        return 2 * self.d * self.d + 2 * self.d * self.d_kv + 3 * self.d * self.mlp

    def weight_bytes(self) -> int:
        """float32, embedding and head untied (tied models store one table: less)."""
        return 4 * (self.layers * self.block_params() + 2 * self.vocab * self.d)

    def block_flops(self, tokens: int, twin: bool = False) -> float:
        """One block on `tokens` tokens of prefill: projections, mlp (twice with the twin), the T^2 attention."""
        per_token = 2 * self.block_params() + 4 * tokens * self.d + (6 * self.d * self.mlp if twin else 0)
        return per_token * tokens

    def head_flops(self, tokens: int) -> float:
        return (2 * self.d * self.vocab + 8 * self.vocab) * tokens  # the head, log-softmax and the KL terms


def parallelize(s: Shape, job: Job, r: Rates, device: dict | None = None) -> dict[str, dict]:
    """FLOPs, bytes, seconds and memory of each part of the main job. device: a GPU for the forward passes."""
    flops_rate = device["flops"] if device else r.ort
    k, n = 2 * s.d + 1, job.tokens - 1
    trials = s.layers if job.trials is None else job.trials
    compensated = s.layers if job.compensated is None else job.compensated
    sums = 2 * k * (3 * s.d + 1) * 8  # NormalEquations.nbytes
    forward = job.fit_windows * s.layers * s.block_flops(job.tokens, twin=True)
    products = job.fit_windows * s.layers * (n * k * k + 2 * n * k * s.d)
    added = job.fit_windows * s.layers * 3 * (k * k + k * s.d) * 8  # float64 sums: read, read the products, write
    solve_flops = s.layers * (4 * k**3 + 2 / 3 * k**3 + 6 * k * k * s.d)
    run = s.layers * s.block_flops(job.tokens) + s.head_flops(job.tokens)
    runs = (1 + trials) * job.selection_windows
    where = runs * compensated * 4 * (s.d * s.d + s.d * s.mlp)  # the compensated switches' weight copies
    parts = {
        "fit forward": dict(flops=forward, bytes=job.fit_windows * s.weight_bytes(), seconds=forward / flops_rate),
        "fit accumulate": dict(flops=products, bytes=added, seconds=products / r.blas32 + added / r.bandwidth),
        "fit solve": dict(flops=solve_flops, bytes=s.layers * 6 * k * k * 8,
                          seconds=s.layers * r.eigh * k**3 + solve_flops / r.blas64),
        "selection": dict(flops=runs * run, bytes=runs * s.weight_bytes() + where,
                          seconds=runs * run / flops_rate + where / (device["bandwidth"] if device else r.bandwidth)),
        "evaluation": dict(flops=2 * job.eval_windows * run, bytes=2 * job.eval_windows * s.weight_bytes(),
                           seconds=2 * job.eval_windows * run / flops_rate),
        "write": dict(flops=0, bytes=s.weight_bytes(), seconds=s.weight_bytes() / r.write),
    }
    bound = job.fit_memory or _fit_memory()
    per_pass = max(1, bound // sums)
    fixes = s.layers * 2 * s.d * s.d * 8  # float64 w_a, w_p kept for every block
    board = s.weight_bytes() + compensated * 4 * (s.d * s.d + s.d * s.mlp)
    reference = job.selection_windows * job.tokens * s.vocab * 4  # the original's log-probs, kept for the KL
    memory = max(s.weight_bytes() + min(s.layers, per_pass) * sums + fixes, board + fixes + reference)
    return {"parts": parts, "memory": memory, "fit_passes": -(-s.layers // per_pass)}


def diagnose(s: Shape, job: Job, r: Rates, device: dict | None = None) -> dict[str, dict]:
    flops_rate = device["flops"] if device else r.ort
    t = job.tokens
    probe = job.diag_windows * (s.layers * (s.block_flops(t, twin=True) + 3 * 2 * t * s.d * s.d) + s.head_flops(t))
    ranks = job.diag_windows * s.layers * 3 * r.eigh * s.d**3
    run = lambda blocks: blocks * s.block_flops(t) + s.head_flops(t)  # noqa: E731
    single = sum(run(s.layers - layer) for layer in range(s.layers))  # a run resuming at its block
    losses = job.diag_eval_windows * (run(s.layers) + 7 * single + 10 * run(s.layers))
    distances = int(np.log2(t - 2)) + 1
    prefix = job.diag_windows * (1 + distances) * run(s.layers)
    zeros = 4 if job.zeros is None else job.zeros
    field = s.layers * zeros * s.d * 6 * s.d * s.mlp  # the Jacobian's d mlp evaluations per zero
    eig = s.layers * zeros * r.eig * (s.d - 1) ** 3
    parts = {
        "probe": dict(flops=probe, bytes=job.diag_windows * s.weight_bytes(), seconds=probe / flops_rate + ranks),
        "critical": dict(flops=field, bytes=s.layers * zeros * s.d * s.d * 4, seconds=field / flops_rate + eig),
        "prefix": dict(flops=prefix, bytes=job.diag_windows * (1 + distances) * s.weight_bytes(), seconds=prefix / flops_rate),
        "losses": dict(flops=losses, bytes=job.diag_eval_windows * 18 * s.weight_bytes(), seconds=losses / flops_rate),
    }
    return {"parts": parts, "memory": 2 * s.weight_bytes() + s.layers * job.diag_eval_windows * t * s.d * 4}


def _fit_memory() -> int:
    from surgery.compensation import memory_bound

    return memory_bound("auto")


def _fmt_seconds(x: float) -> str:
    return f"{x:.0f} s" if x < 600 else f"{x / 60:.0f} min" if x < 36000 else f"{x / 3600:.0f} h"


def _measured(run: Path) -> dict:
    """Seconds of each part and the peak RSS of a run folder (module docstring)."""
    out: dict = {}
    log = Path(str(run) + ".time")
    if log.is_file():
        text = log.read_text()
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1).split(":")
        out["wall"] = sum(float(x) * 60**i for i, x in enumerate(reversed(wall)))
        out["rss"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) * 1024
    if (run / "selection.json").is_file():
        outcome = json.loads((run / "selection.json").read_text())
        sel = outcome["selection"]
        out["windows"] = {part: w["count"] for part, w in outcome["windows"].items()}
        split = sel.get("fit_seconds") or {}
        out.update({"fit forward": split.get("forward"), "fit accumulate": split.get("accumulate"), "fit solve": split.get("solve"),
                    "selection": sel["seconds"].get("selection"), "trials": len(sel["trials"]), "fit_memory": sel.get("fit_memory")})
        out["kind"] = "parallelize"
    elif (run / "report.json").is_file():
        report = json.loads((run / "report.json").read_text())
        seconds = report["seconds"]
        out.update({"probe": seconds.get("probe"), "critical": seconds.get("critical"), "prefix": seconds.get("prefix"),
                    "losses": seconds.get("losses")})
        out["windows"] = {part: w["count"] for part, w in report["windows"].items()}
        out["zeros"] = np.mean([len(layer["points"]) for layer in report.get("critical", {}).get("layers", [])] or [4])
        out["kind"] = "diagnose"
    return out


def validate(specs: list[str], rates: Rates) -> str:
    rows = []
    for spec in specs:
        name, layers, run = spec.split(":", 2)
        shape = Shape(**SHAPES[name], layers=int(layers))
        got = _measured(Path(run))
        if got["kind"] == "parallelize":
            w = got["windows"]
            job = Job(fit_windows=w["fit"], selection_windows=w["selection"], eval_windows=w["evaluation"], trials=got["trials"],
                      fit_memory=got["fit_memory"])
            cost = parallelize(shape, job, rates)
        else:
            w = got["windows"]
            job = Job(diag_windows=w["calibration"], diag_eval_windows=w["evaluation"], zeros=int(round(got["zeros"])))
            cost = diagnose(shape, job, rates)
        for part, c in cost["parts"].items():
            if got.get(part) is not None:
                rows.append({"run": f"{name} x{layers} {got['kind']}", "part": part, "predicted": f"{c['seconds']:.1f} s",
                             "measured": f"{got[part]:.1f} s", "ratio": f"{c['seconds'] / got[part]:.2f}"})
        if "wall" in got:
            total = sum(c["seconds"] for c in cost["parts"].values())
            rows.append({"run": f"{name} x{layers} {got['kind']}", "part": "whole command (wall)", "predicted": f"{total:.1f} s",
                         "measured": f"{got['wall']:.1f} s", "ratio": f"{total / got['wall']:.2f}"})
        if "rss" in got:
            rows.append({"run": f"{name} x{layers} {got['kind']}", "part": "peak memory", "predicted": f"{cost['memory'] / 1e9:.2f} GB",
                         "measured": f"{got['rss'] / 1e9:.2f} GB", "ratio": f"{cost['memory'] / got['rss']:.2f}"})
    return table(rows, ["run", "part", "predicted", "measured", "ratio"])


def project(rates: Rates) -> str:
    rows = []
    for name, layers in LAYERS.items():
        shape = Shape(**SHAPES[name], layers=layers)
        for where, device in (("this CPU", None), (GPU["name"], GPU)):
            main, diag = parallelize(shape, Job(), rates, device), diagnose(shape, Job(), rates, device)
            seconds = {part: c["seconds"] for part, c in {**main["parts"], **diag["parts"]}.items()}
            fit = sum(v for k, v in seconds.items() if k.startswith("fit"))
            job_total = sum(c["seconds"] for c in main["parts"].values())
            top = max(main["parts"], key=lambda p: main["parts"][p]["seconds"])
            rows.append({
                "model": f"{name} ({shape.weight_bytes() / 1e9:.1f} GB fp32)", "on": where,
                "fit (fwd / acc / solve)": f"{_fmt_seconds(fit)} ({' / '.join(_fmt_seconds(seconds[p]) for p in ('fit forward', 'fit accumulate', 'fit solve'))})",
                "selection": _fmt_seconds(seconds["selection"]), "main job": _fmt_seconds(job_total),
                "dominant": top, "diagnose": _fmt_seconds(sum(c["seconds"] for c in diag["parts"].values())),
                "memory": f"{main['memory'] / 1e9:.1f} GB", "fit passes": main["fit_passes"],
                "TFLOP": f"{sum(c['flops'] for c in main['parts'].values()) / 1e12:.0f}",
            })
    return table(rows, ["model", "on", "fit (fwd / acc / solve)", "selection", "main job", "dominant", "diagnose", "memory", "fit passes", "TFLOP"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", nargs="*", default=None, metavar="SHAPE:LAYERS:RUN")
    args = parser.parse_args()
    rates = Rates.measure()
    print("rates on this machine: " + ", ".join([
        f"ORT MatMul {rates.ort / 1e9:.0f} GFLOP/s", f"NumPy fp32 {rates.blas32 / 1e9:.0f} GFLOP/s", f"fp64 {rates.blas64 / 1e9:.0f} GFLOP/s",
        f"eigh {rates.eigh * 1e9:.2f} s per 1000^3", f"eig {rates.eig * 1e9:.2f} s per 1000^3",
        f"memory {rates.bandwidth / 1e9:.1f} GB/s", f"disk {rates.write / 1e9:.2f} GB/s"]) + "\n")
    if args.validate:
        print(validate(args.validate, rates) + "\n")
    print(project(rates))


if __name__ == "__main__":
    main()
