"""Does surgery's evaluation give the same numbers on CUDA as on the CPU? (issue 36, item 3)

    python benchmarks/cuda_equal.py [--ray]    # on a machine with an NVIDIA GPU and onnxruntime-gpu (benchmarks/gpu.sh runs it)
    python benchmarks/cuda_equal.py --smoke    # CPU against CPU: checks the script, compares nothing

The committed tiny fixtures (float32: graphs/tiny-llama, graphs/tiny-gpt2), each against its plain parallel rewrite
of every block, scored by surgery.measure.scoring.compare on 16 windows of 32 random token ids (no tokenizer: the GPU
machine has none) on the CPU and on CUDA. One row per fixture: the original's loss, the rewrite's loss, KL and top-1
on each device and the largest difference; exits 1 when a difference passes --tolerance (1e-4), or KL's relative
difference passes 1e-3 (the fixtures' KL is small, so 1e-4 alone would say little about it).

--ray (ray and tokenizers needed): `surgery diagnose graphs/tiny-llama --only deficit,defect,ablation --workers 1
--device cuda` against the same diagnose in this process on CUDA (2 + 2 windows of 32 tokens of the built-in corpus):
the one Ray actor asks for the GPU (num_gpus 1) and scores every window there. Every number of the two reports (the
steps' seconds aside) must agree to --tolerance, relative to the number's size where that passes 1.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from common import ROOT, table

from surgery.engine import runtime
from surgery.files import graph
from surgery.jobs.job import parallel_form
from surgery.measure import scoring, statistics
from surgery.model.blocks import find_blocks
from surgery.model.embedding import embedding_table
from surgery.text import data

FIXTURES = ("tiny-llama", "tiny-gpt2")
KL_RELATIVE = 1e-3


def scores(models: list, windows: data.Windows, device: str) -> dict[str, float]:
    """The original's loss and the rewrite's loss, KL and top-1, on `device`: models = [original, rewrite]."""
    base, other = scoring.compare(models, windows, batch_size=4, options=runtime.Options(device=device))
    div = statistics.divergence(other)
    return {"loss": base.loss, "parallel loss": other.loss, "KL": div.kl, "top-1": div.top1}


def random_windows(model, n: int = 16, seq_len: int = 32, seed: int = 0) -> data.Windows:
    vocab, _ = embedding_table(model)  # read from the graph: no session for it
    ids = np.random.default_rng(seed).integers(0, vocab, (n, seq_len), dtype=np.int64)
    return data.Windows(ids, np.zeros(n, np.int64), np.arange(n, dtype=np.int64) * seq_len, "random ids")


def numbers(report, path: str = "") -> dict[str, float]:
    """Every number of a report.json dict by its path, the steps' seconds and the tool's version left out."""
    if isinstance(report, dict):
        return {k: v for key, value in report.items() if key not in ("seconds", "tool") for k, v in numbers(value, f"{path}/{key}").items()}
    if isinstance(report, list):
        return {k: v for i, value in enumerate(report) for k, v in numbers(value, f"{path}/{i}").items()}
    return {path: float(report)} if isinstance(report, (int, float)) and not isinstance(report, bool) else {}


def ray_check(device: str, tolerance: float) -> tuple[dict, bool]:
    """diagnose on one Ray actor (with a GPU on cuda) against diagnose in this process: one row and whether they agree."""
    from surgery.diagnostics import DiagnoseSettings, diagnose
    from surgery.engine.cluster import Resources
    from surgery.text.data import DataSettings

    settings = DiagnoseSettings(DataSettings(seq_len=32), windows=2, eval_windows=2, only=("deficit", "defect", "ablation"))
    runs = [numbers(diagnose(ROOT / "graphs" / "tiny-llama", settings, Resources(runtime.Options(device=device), workers)).to_json())
            for workers in (None, 1)]
    here, actor = runs
    if set(here) != set(actor) or not here:
        return {"check": "Ray actor", "verdict": f"the reports differ in shape: {sorted(set(here) ^ set(actor))[:5]}"}, False
    worst = max(abs(here[k] - actor[k]) / max(1.0, abs(here[k])) for k in here)
    return {"check": f"diagnose tiny-llama, 1 Ray actor on {device} / this process on {device}", "numbers": str(len(here)),
            "largest difference": f"{worst:.1e}"}, worst <= tolerance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU against CPU: checks the script, compares nothing")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--ray", action="store_true", help="also diagnose on one Ray actor with a GPU against this process (needs ray)")
    args = parser.parse_args()
    if not args.smoke and not runtime.cuda_usable():
        print("benchmarks/cuda_equal.py needs an NVIDIA GPU with a working CUDAExecutionProvider; `--smoke` checks the script on CPU", file=sys.stderr)
        sys.exit(1)
    other = "cpu" if args.smoke else "cuda"
    rows, worst, ok = [], 0.0, True
    for name in FIXTURES:
        model = graph.load(ROOT / "graphs" / name)
        models = [model, parallel_form(model, range(len(find_blocks(model)))).model]  # passes leave their input as it was
        windows = random_windows(model)
        cpu, dev = scores(models, windows, "cpu"), scores(models, windows, other)
        diff, kl_rel = max(abs(cpu[k] - dev[k]) for k in cpu), abs(cpu["KL"] - dev["KL"]) / cpu["KL"]
        worst, ok = max(worst, diff), ok and diff <= args.tolerance and kl_rel <= KL_RELATIVE
        rows.append({"fixture": name, **{f"{k} cpu / {other}": f"{cpu[k]:.6f} / {dev[k]:.6f}" for k in cpu},
                     "largest difference": f"{diff:.1e}", "KL relative difference": f"{kl_rel:.1e}"})
    print(table(rows, list(rows[0])))
    if args.ray:
        row, same = ray_check(other, args.tolerance)
        print("\n" + table([row], list(row)))
        ok = ok and same
    verdict = "equal" if ok else "NOT equal"
    print(f"\n{verdict}: largest difference {worst:.1e} (tolerance {args.tolerance:g}, KL relative {KL_RELATIVE:g})"
          f"{'; smoke: CPU against CPU' if args.smoke else ''}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
