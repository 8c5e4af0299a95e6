"""The main job's printed summary: `surgery parallelize --layers auto`'s lines, from its Outcome."""

from __future__ import annotations

import textwrap
from pathlib import Path

from surgery.model.layers import format_layers
from surgery.report.numbers import dnll, kl, pm, points, share


def lines(outcome, written: Path, budget, repeats: int) -> list[tuple[str, str]]:
    """parallelize --layers auto's report, (key, value) lines: what was chosen, what it cost, what it gives."""
    sel = outcome.selection
    forms = sel.counts()
    codes = {"gptq": "codes chosen error-aware", "nearest": "codes rounded to nearest"}.get(sel.requantize)
    split = f": {forms['compensated']} compensated{f' (MatMulNBits {codes})' if codes else ''}, {forms['plain']} plain" if sel.fit else ""
    w = outcome.windows
    fit_line = f"{sel.fit_passes} fit pass{'es' if sel.fit_passes != 1 else ''} over {w['fit']['count']} fit windows{' (with the refit)' if sel.refit else ''}, " if sel.fit else ""
    lines = [
        ("chosen layers", f"{format_layers(sel.layers) or 'none'} ({len(sel.layers)} of {sum(c is not None for c in sel.c)} sequential blocks{split}; form {outcome.form})"),
        ("ranked by", f"{sel.score}, lowest first; {len({t.layer for t in sel.trials})} of {sel.candidates} candidates tried, "
                      f"{len(sel.trials)} trials, {len(sel.layers)} kept" + (f"; stopped: {sel.stopped}" if sel.stopped else "")),
        ("forward passes", f"{fit_line}{sel.forward_passes} over {w['selection']['count']} selection windows (1 baseline + 1 per trial{' + 1 after the refit' if sel.refit else ''}"
                           f"{_blocks_run(sel)})"),
        ("budget", f"{budget} nats on the selection windows' point estimates" if budget.max_kl is not None or budget.max_loss_increase is not None
                   else "none (--max-kl none, --max-loss-increase none)"),
    ]
    if digest := w["evaluation"].get("corpus_digest"):
        name = w["evaluation"]["corpus"].split(" (")[0]
        lines.append(("corpus", f"{name}, text sha256 {digest[:16]} (selection.json: each window set's corpus_digest and ids_digest)"))
    if sel.divergence is not None:
        lines.append(("selection", f"KL {kl(sel.divergence)}, top-1 {100 * sel.divergence.top1:.1f} %, dNLL {dnll(sel.dnll)} ({w['selection']['tokens']} tokens)"))
    if sel.refit:
        r = sel.refit
        lines.append(("refit", f"KL {r['kl_before']['kl']:.4f} -> {r['kl_after']['kl']:.4f}, dNLL {r['dnll_before']['dnll']:+.4f} -> "
                               f"{r['dnll_after']['dnll']:+.4f} on the selection windows: {'kept' if r['kept'] else 'not kept'}"))
    lines += [
        ("evaluation", f"KL {kl(outcome.divergence_eval)}, top-1 {100 * outcome.divergence_eval.top1:.1f} %, dNLL {dnll(outcome.dnll_eval)} "
                       f"({outcome.eval_tokens} held-out tokens, base loss {outcome.base_loss_eval:.4f}{_samples(w['evaluation'])}; 95 % intervals, nats)"),
        *([("over budget", _over_budget(outcome))] if outcome.over_budget else []),
        *([("llama.cpp", (f"Same top p {pm(lc, 'Same top p')}, 99.9% KLD {lc['99.9% KLD']:.4f}, RMS Δp {pm(lc, 'RMS Δp')} "
                          "(evaluation windows; selection.json has all of `perplexity --kl-divergence`'s)"))] if (lc := outcome.divergence_eval.to_json().get("llama_cpp")) else []),
        *([("tasks", _tasks(outcome.tasks))] if outcome.tasks else []),
        ("speedup, estimate", f"{outcome.estimated_speedup:.3f}x (paper's estimate: max(t_attn, t_mlp) per parallel block, from kernel times"
                              f"{f' on {outcome.estimate_placement}' if outcome.estimate_placement else ''})"),
    ]
    if outcome.prefill_ratio is not None:
        decode = f", decode {outcome.decode_ratio:.3f}x" if outcome.decode_ratio else ""
        lines.append(("speedup, measured", f"prefill {outcome.prefill_ratio:.3f}x{decode} (original / rewritten, {repeats} interleaved repeats)"))
    split = ", ".join(f"{k} {v:.0f} s" for k, v in sel.fit_seconds.items())
    seconds = ", ".join(f"{k} {v:.0f} s" + (f" ({split})" if k == "fit" and split else "") for k, v in (sel.seconds | outcome.seconds).items())
    resumed = [("resumed", "from the work folder's finished units: " + ", ".join(f"{k} {v}" for k, v in outcome.resumed.items()))] if outcome.resumed else []
    kept = outcome.checkpoints
    if kept.get("units"):
        fate = "kept for --frontier-point" if outcome.frontier else "removed now the run is done"
        resumed.append(("checkpoints", f"{kept['units']} units written to {written.parent if written.name == 'model.onnx' else written}.work in "
                                       f"{kept['seconds']:.1f} s ({kept['bytes'] / 2**20:.0f} MiB; {fate})"))
    if frontier := outcome.frontier:
        lines.append(("frontier", f"{len(frontier['points'])} points, the budget's at {frontier['budget_point']}; {len(frontier['walk'])} trials past the budget; "
                                  f"stopped: {frontier['stopped'] or 'at the budget'} (table below; frontier.json, frontier.png)"))
    extra = "selection.json, selection.png" + (", frontier.json, frontier.png" if outcome.frontier else "")
    return lines + [("time", seconds), *resumed, ("written", f"{written} (+ {extra})")]


def _over_budget(outcome) -> str:
    """In words: which limit the held-out windows read over, and what that means (the budget holds on the selection windows)."""
    names = {"kl": ("KL", "--max-kl", "{:.4f}"), "dnll": ("dNLL", "--max-loss-increase", "{:+.4f}")}
    parts = [f"{names[k][0]} {names[k][2].format(v['evaluation'])} > {names[k][1]} {v['limit']:g}" for k, v in outcome.over_budget.items()]
    return (f"held out, {' and '.join(parts)}: the budget was held on the {outcome.windows['selection']['count']} selection windows' point "
            "estimates, and on other text this set costs about the evaluation's numbers; for a set that stays within it there too, "
            "lower the limits or raise --windows")


def _tasks(compared: dict) -> str:
    """The accuracy kept on the downstream tasks, and each task's accuracies: `kept 98.1 % [95.0, 101.2]; arc_easy acc_norm 52.1 -> 51.0 ...`."""
    kept = compared["kept"][0]
    parts = []
    for name, task in compared["tasks"].items():
        first, rewritten = task["models"]
        metric = task["headline"]
        d = rewritten["vs_first"][metric]
        parts.append(f"{name} {metric} {100 * first[metric]:.1f} -> {100 * rewritten[metric]:.1f} ({points(d['difference'], d['low'], d['high'])})")
    documents = sorted({task["documents"] for task in compared["tasks"].values()})
    return (f"accuracy kept {share(kept['kept'], kept['low'], kept['high'])} (mean over tasks, rewritten / original); "
            + ", ".join(parts) + f"; points, paired 95 % intervals, {'/'.join(map(str, documents))} documents each")


def _blocks_run(sel) -> str:
    """How much of the selection's passes the trials that start at a later block saved, when they did: `; 43 % of the blocks run`."""
    whole = sel.forward_passes * (len(sel.c) or 1)
    return f"; trials start at their block, {100 * sel.blocks_run / whole:.0f} % of the blocks run" if 0 < sel.blocks_run < whole else ""


def _samples(part: dict) -> str:
    """What a part's share of the model's own samples means for its numbers (nothing without samples)."""
    k = part.get("sampled", 0)
    return f"; {k} of {part['count']} windows the model's own samples: KL and top-1 count them, loss and dNLL do not" if k else ""


def frontier_cost(tasks, frontier) -> str:
    """What --tasks will cost on a frontier, said before the work starts."""
    names = [task.name for task in tasks.chosen()]
    documents = f"the first {tasks.limit} documents" if tasks.limit else "every document"
    every = "every point" if frontier.every == 1 else f"points {frontier.every}, {2 * frontier.every}, {3 * frontier.every}, ..."
    return (f"frontier: task accuracy at {every} and the budget's: {len(names)} tasks ({', '.join(names)}) on {documents} of each, "
            "one run per such point, and the original's once (--frontier-every, --task-limit)")


def frontier_table(frontier: dict) -> list[str]:
    """The frontier as lines of at most 80 characters: per point k, the block it adds, held-out KL and dNLL with their 95 %
    intervals, top-1, the speed estimate (and measured prefill ratio) and the accuracy kept where measured."""
    rows = [f"{'k':>2} {'block':>5}  {'KL [95 % CI]':<22} {'dNLL [95 % CI]':<25} {'top-1':>5} {'speed':>6} {'kept %':>7}"]
    for p in frontier["points"]:
        e = p["evaluation"]
        kl_text = f"{e['kl']:.4f} [{e['kl_interval'][0]:.4f},{e['kl_interval'][1]:.4f}]"
        dnll_text = f"{e['dnll']:+.4f} [{e['dnll_interval'][0]:+.4f},{e['dnll_interval'][1]:+.4f}]"
        speed = p["speedup_measured"]["prefill"] if p["speedup_measured"] else p["speedup_estimate"]
        kept = f"{100 * p['tasks']['kept'][0]:.1f}" if p["tasks"] else ""
        mark = "*" if p["k"] == frontier["budget_point"] else " "
        rows.append(f"{p['k']:>2} {p['layer']:>4}{p['form'][0]}{mark} {kl_text:<22} {dnll_text:<25} {100 * e['top1_agreement']:>5.1f} {speed:>5.3f}x {kept:>7}".rstrip())
    measured = "measured prefill ratio where --frontier-latency timed it, else the paper's estimate"
    legend = (f"* the budget's point. Held-out windows, nats; block: the one each point adds (c compensated, p plain); speed: {measured}; "
              f"kept: mean task accuracy, point / original. The walk stopped: {frontier['stopped'] or 'at the budget'}.")
    return rows + textwrap.wrap(legend, 80)
