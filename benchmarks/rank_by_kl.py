"""Does ranking the candidates by their own measured KL, instead of C_l^comp, let the default main job keep more
blocks? SmolLM2-135M, the main job's defaults otherwise.

    python benchmarks/rank_by_kl.py [--windows 16]

Fits every block's fix as the main job does (the same 64 fit windows), measures each block alone, compensated,
against the original on the first `--windows` of the main job's 16 selection windows (one trial per block), then runs
`job.auto` with the fits' C_l^comp replaced by those KLs, so the greedy tries the blocks in that order.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from common import ROOT, smollm2

from surgery import compensation, data, evaluate, graph, job, trials
from surgery.analysis import switchboard as board_graph
from surgery.compensation import KINDS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=16)
    args = parser.parse_args()
    folder = smollm2()
    model = graph.load(folder)
    n = len(compensation.find_blocks(model))
    fit_windows, selection = data.deal(data.windows(folder, part="calibration", max_windows=80), [64, 16], ["fit", "selection"])
    start = time.perf_counter()
    fits = compensation.fit(model, fit_windows)
    fixes = {l: f.fix for l, f in fits.items() if f.fix is not None}
    scorer = evaluate.Scorer(board_graph.switchboard(model, KINDS, fixes), compare=True)
    ranking = selection.take(range(args.windows))
    reference: list = []
    scorer(ranking, batch_size=trials.BATCH, extra={board_graph.SWITCHES: board_graph.switches(KINDS, n)}, record=reference)
    kl = {}
    for layer in fixes:
        on = {board_graph.SWITCHES: board_graph.switches(KINDS, n, {KINDS[0]: {layer}, KINDS[1]: {layer}})}
        kl[layer] = evaluate.divergence(scorer(ranking, batch_size=trials.BATCH, extra=on, reference=reference)).kl
    print(f"fit and {len(kl)} single-block trials: {time.perf_counter() - start:.0f} s")
    print("by KL:    ", sorted(kl, key=kl.get))
    print("by c_comp:", sorted(fixes, key=lambda l: fits[l].c_comp))
    ranked = {l: dataclasses.replace(f, c_comp=kl.get(l, f.c_comp)) for l, f in fits.items()}
    compensation.fit = lambda *a, **k: ranked  # the main job's greedy, in the KL order
    outcome, _ = job.auto(folder, ROOT / "out" / "rank-by-kl", measure_latency=False)
    s, ev = outcome.selection, outcome.divergence_eval
    print(f"kept {list(s.layers)}: selection KL {s.divergence.kl:.4f}, dNLL {s.dnll.dnll:+.4f}; "
          f"held out KL {ev} top-1 {100 * ev.top1:.1f} %, dNLL {outcome.dnll_eval}")


if __name__ == "__main__":
    main()
