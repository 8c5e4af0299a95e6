"""What a resumed selection trial costs against one from block 0: trials.Trials on the main job's 16 selection
windows of SmolLM2-135M, each start timed three times, interleaved (benchmarks/cost.py prices a trial as the head
plus the blocks from its start on).

    python benchmarks/resumed_trials.py [--starts 15,29]
"""

from __future__ import annotations

import argparse
import time

from common import main_job_windows, smollm2

from surgery import cluster, graph, runtime
from surgery.blocks import find_blocks
from surgery.trials import Trials


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", default="15,29", help="blocks the timed trials add (and start at)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = smollm2()
    model = graph.load(folder)
    _, selection, _ = main_job_windows(folder)
    n = len(find_blocks(model))
    resumed = Trials(model, {}, selection, list(range(n)), cluster.Pool(), runtime.Options())
    whole = Trials(model, {}, selection, list(range(n)), cluster.Pool(), runtime.Options(), baseline=resumed)  # never resumes
    runs = [("from block 0", resumed, None), ("plain switchboard, from block 0", whole, None)]
    runs += [(f"from block {b}", resumed, b) for b in (int(x) for x in args.starts.split(","))]
    for r in range(args.rounds):
        for name, trials, new in runs:
            start = time.perf_counter()
            trials.loss({n - 1 if new is None else new: "plain"}, new)
            print(f"round {r}: {name}: {time.perf_counter() - start:.2f} s ({len(selection)} windows)", flush=True)


if __name__ == "__main__":
    main()
