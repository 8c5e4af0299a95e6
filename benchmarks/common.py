"""Shared by the benchmark scripts: the repository on sys.path, the exported SmolLM2-135M (made once under out/),
markdown tables, the GPU's name and kl_budget.py's drift refit. Not run by itself."""

from __future__ import annotations

import subprocess
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
    """A markdown table of `rows` (already formatted strings; a cell a row lacks is left blank)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def gpu_name() -> str:
    """The GPU's name and driver, from nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "GPU name unknown (no nvidia-smi)"
    except (OSError, subprocess.TimeoutExpired):
        return "GPU name unknown (no nvidia-smi)"
