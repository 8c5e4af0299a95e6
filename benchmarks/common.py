"""Shared by the benchmark scripts: the exported SmolLM2-135M, made once under out/."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOLLM2 = ROOT / "out" / "smollm2"


def smollm2() -> Path:
    """The optimum export of SmolLM2-135M (KV cache), exported on first use."""
    if not (SMOLLM2 / "model.onnx").is_file():
        from surgery.export import export

        export("smollm2-135m", SMOLLM2)
    return SMOLLM2


def main_job_windows(folder):
    """The windows as the main job deals them (its 80 calibration windows, evenly spaced: 64 fit, 16 selection) and
    the *tuning* windows, the calibration windows it leaves out (27 of the built-in corpus's 107): (fit, selection,
    tuning)."""
    from surgery import data

    every = data.windows(folder, seq_len=256, part="calibration")
    cal = data.windows(folder, seq_len=256, max_windows=80, part="calibration")
    fit, selection = data.deal(cal, [64, 16], ["fit", "selection"])
    used = set(cal.starts)
    return fit, selection, every.take([i for i, start in enumerate(every.starts) if start not in used], "tuning")


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `rows` (already formatted strings)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def drift_refit(model, fit_windows, chosen, fixes: dict, stream: dict) -> dict:
    """Each chosen block's fix, in layer order, refitted by compensation.fit(drift=stream): aimed at the original
    resid_post, on the stream of the model whose earlier chosen blocks are already rewritten (one fit pass per block)."""
    from surgery import compensation
    from surgery.compensation import KINDS

    fixes = dict(fixes)
    for layer in sorted(chosen)[1:]:
        before = {l for l in chosen if l < layer}
        on = {KINDS[0]: before, KINDS[1]: before & set(fixes)}
        fixes[layer] = compensation.fit(model, fit_windows, {layer}, fixes=fixes, on=on, drift=stream)[layer].fix
    return fixes


def kl_score(model, layers, fixes, windows) -> str:
    """KL, top-1 agreement and dNLL of `model` with `layers` compensated by `fixes`, against `model`, on `windows`."""
    from surgery import evaluate
    from surgery.job import rewrite

    base, after = evaluate.compare([model, rewrite(model, layers, fixes=fixes).model], windows)
    kl = evaluate.divergence(after)
    return f"KL {kl}  top-1 {100 * kl.top1:.1f} %  dNLL {evaluate.delta(base, after)}"


def lm_head(model, path):
    """The MatMul that gives `logits` and its weight [d_model, vocab] as an array (optimum's tied export:
    Transpose(embed_tokens)); exits with one line when logits come from another op."""
    head = next(o for o in model.graph.outputs if o.name == "logits").producer()
    if head.op_type != "MatMul":
        raise SystemExit(f"{path}: logits come from {head.op_type}, not a MatMul")
    weight = head.inputs[1]
    tied = weight.const_value is None
    return head, weight.producer().inputs[0].const_value.numpy().T if tied else weight.const_value.numpy()
