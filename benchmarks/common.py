"""Shared by the benchmark scripts: the repository on sys.path, the exported SmolLM2-135M (made once under out/),
markdown tables and kl_budget.py's drift refit. Not run by itself."""

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
