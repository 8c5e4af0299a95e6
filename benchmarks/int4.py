"""Compensated blocks on SmolLM2's GenAI int4 build: what choosing the codes of W_o (I + w_a) and W_down (I + w_p)
round-to-nearest or error-aware (GPTQ) keeps of the fix, on one fixed set of blocks.

    python benchmarks/int4.py [--layers 6-7,25,27-29] [--single]

The int4 model is the GenAI builder's (`-p int4 -e cpu`, accuracy_level 4), built under out/ on first use. The
fixes are fitted once, as `surgery parallelize` fits them (the same 64 fit windows, dealt with the 16 selection
windows from 80 calibration windows); both requantizations fold the same fix on the node's own scales. Scored
against the int4 original on 16 *tuning* windows (calibration windows the main job does not use: disjoint from the
fit and selection windows and from the evaluation part), where a default may be chosen, and on the 8 held-out
evaluation windows the main job reports. --single: each block alone as well, on the tuning windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from common import ROOT, table

from surgery import compensation, data, evaluate, graph
from surgery.blocks import find_blocks
from surgery.job import rewrite
from surgery.layers import parse_layers
from surgery.nodes import values_by_name
from surgery.passes import projection

INT4 = ROOT / "out" / "smollm2-genai-int4"


def int4_folder():
    if not (INT4 / "model.onnx").is_file():
        from deployed import hf_folder

        from graphs.deployed import genai_build

        genai_build(hf_folder()[0], INT4, "int4")
    return INT4


def scored(model, rewritten: dict, windows) -> dict[str, dict]:
    names = list(rewritten)
    scores = evaluate.compare([model, *rewritten.values()], windows)
    rows = {}
    for name, after in zip(names, scores[1:]):
        kl, d = evaluate.divergence(after), evaluate.delta(scores[0], after)
        rows[name] = {"KL [95 % CI]": str(kl), "KL p99": f"{kl.p99:.3f}", "top-1": f"{100 * kl.top1:.1f} %", "dNLL [95 % CI]": str(d)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="6-7,25,27-29")
    parser.add_argument("--single", action="store_true")
    args = parser.parse_args()
    folder = int4_folder()
    model = graph.load(folder)
    layers = sorted(parse_layers(args.layers, 30))
    calibration = data.windows(folder, part="calibration")
    used = np.unique(np.linspace(0, len(calibration) - 1, 80).round().astype(int))  # as data.windows(max_windows=80) picks
    fit_windows, _ = data.deal(calibration.take(used), [64, 16], ["fit", "selection"])
    rest = np.setdiff1d(np.arange(len(calibration)), used)
    tuning = calibration.take(rest[np.unique(np.linspace(0, len(rest) - 1, 16).round().astype(int))], "tuning")
    held_out = data.windows(folder, max_windows=8)

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    fits = compensation.fit(model, fit_windows, layers, requantize="gptq", seconds=seconds)
    print(f"fit of {len(layers)} blocks with the inputs' second moments: {time.perf_counter() - start:.0f} s "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())})")
    aware = {l: fits[l].fix for l in layers}
    nearest = {l: dataclasses.replace(f, packed=(None, None)) for l, f in aware.items()}

    blocks, values, changed = find_blocks(model), values_by_name(model), []
    for layer, fix in aware.items():  # how many codes each requantization moves, and that unfixed weights keep theirs
        attn, mlp = projection.outputs(values, blocks[layer], "compensate")
        for p, (w, _), packed in zip((attn, mlp), fix.fold(attn, mlp), fix.packed):
            assert np.array_equal(p.quant.round(p.weight), p.quant.codes)
            own = p.quant.packed(p.quant.codes)
            changed.append((np.mean(p.quant.packed(p.quant.round(w)) != own), np.mean(packed != own)))
    moved = np.mean(changed, axis=0)
    print(f"unfixed weights requantized: the node's own codes in all {len(changed)} projections (KL 0 by construction)")
    print(f"bytes of the packed codes changed by the fold: nearest {100 * moved[0]:.1f} %, error-aware {100 * moved[1]:.1f} %")

    forms = {"plain": rewrite(model, layers).model,
             "compensated, nearest": rewrite(model, layers, fixes=nearest).model,
             "compensated, error-aware (GPTQ)": rewrite(model, layers, fixes=aware).model}
    rows = []
    for windows, what in ((tuning, "16 tuning"), (held_out, "8 held-out")):
        for name, row in scored(model, forms, windows).items():
            rows.append({"form": name, "windows": what, **row})
    columns = ["form", "windows", "KL [95 % CI]", "KL p99", "top-1", "dNLL [95 % CI]"]
    print(f"\nblocks {args.layers} vs the int4 original\n")
    print(table(rows, columns))
    if args.single:
        rows = []
        for layer in layers:
            single = {"plain": rewrite(model, [layer]).model, "nearest": rewrite(model, [layer], fixes={layer: nearest[layer]}).model,
                      "error-aware": rewrite(model, [layer], fixes={layer: aware[layer]}).model}
            rows.append({"block": layer, **{name: row["KL [95 % CI]"] for name, row in scored(model, single, tuning).items()}})
        print("\neach block alone, KL on the tuning windows\n")
        print(table(rows, ["block", "plain", "nearest", "error-aware"]))


if __name__ == "__main__":
    main()
