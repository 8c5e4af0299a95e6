"""What checkpoints cost and what a resume saves, on the default main job (SmolLM2-135M, the built-in corpus).

    python benchmarks/faults.py                        # 2 rounds (with, without, without, with), then 2 kills
    python benchmarks/faults.py --rounds 1 --kills "selection trial-10"

1. Cost: `surgery parallelize out/smollm2 -o OUT` with checkpoints (the default) and with --no-checkpoints, interleaved
   in ABBA rounds so that the machine's drift falls on both; wall time of each run, and the work folder's largest size
   (polled every 0.2 s; a finished run removes it).
2. Saving: the job killed (SIGKILL) when it reaches a named unit (SURGERY_PAUSE_AT, surgery/checkpoint.py), then the
   same command again: how long the resume took against a run from scratch, and whether its output equals the
   uninterrupted run's (the layers, selection.json's numbers but the timings, model.onnx byte for byte).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, smollm2, table

TIMES = {"seconds", "fit_seconds", "latency", "fit_memory", "estimated_speedup", "prefill_ratio", "decode_ratio", "resumed", "checkpoints"}


def _command(model: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "surgery.cli", "parallelize", str(model), "-o", str(out), "--json", *extra]


def _folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:  # renamed or removed while we looked
            pass
    return total


def _run(command: list[str], work: Path, env: dict | None = None, pause: Path | None = None) -> dict:
    """Run the job; its wall time, the work folder's largest size, its JSON report (None when killed at `pause`)."""
    largest, stop = [0], threading.Event()

    def poll():
        while not stop.is_set():
            largest[0] = max(largest[0], _folder_bytes(work) if work.exists() else 0)
            stop.wait(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    start = time.perf_counter()
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    if pause is not None:
        while not pause.exists() or not pause.read_text():
            if run.poll() is not None:
                raise SystemExit(f"the job ended before its pause: {run.stderr.read()}")
            time.sleep(0.05)
        run.send_signal(signal.SIGKILL)
    stdout, stderr = run.communicate()
    seconds = time.perf_counter() - start
    stop.set()
    watcher.join()
    if pause is None and run.returncode != 0:
        raise SystemExit(stderr)
    return {"seconds": seconds, "work_bytes": largest[0], "report": json.loads(stdout) if pause is None else None}


def _numbers(report, path=""):
    if isinstance(report, dict):
        for key, value in report.items():
            if key not in TIMES and key != "out":
                yield from _numbers(value, f"{path}/{key}")
    elif isinstance(report, list):
        for i, value in enumerate(report):
            yield from _numbers(value, f"{path}/{i}")
    else:
        yield path, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds of the interleaved cost runs")
    parser.add_argument("--kills", default="fit outputs window 40,selection trial-10", help="units to kill the job at, comma-separated")
    args = parser.parse_args()
    model = smollm2()
    scratch = Path(tempfile.mkdtemp(prefix="faults-", dir=ROOT / "out"))
    runs: dict[str, list[dict]] = {"checkpoints": [], "no checkpoints": []}
    for r in range(args.rounds):
        for kind in ("checkpoints", "no checkpoints") if r % 2 == 0 else ("no checkpoints", "checkpoints"):
            out = scratch / f"{kind.replace(' ', '-')}-{r}"
            extra = () if kind == "checkpoints" else ("--no-checkpoints",)
            runs[kind].append(_run(_command(model, out, *extra), out.with_name(out.name + ".work")))
            print(f"round {r}: {kind} {runs[kind][-1]['seconds']:.1f} s, work folder up to {runs[kind][-1]['work_bytes'] / 2**20:.0f} MiB", flush=True)
    rows = []
    for kind, done in runs.items():
        rows.append({"run": kind, "seconds": ", ".join(f"{d['seconds']:.1f}" for d in done),
                     "mean": f"{sum(d['seconds'] for d in done) / len(done):.1f}",
                     "work folder, largest": f"{max(d['work_bytes'] for d in done) / 2**20:.0f} MiB"})
    mean = {k: sum(d["seconds"] for d in v) / len(v) for k, v in runs.items()}
    print(table(rows, ["run", "seconds", "mean", "work folder, largest"]))
    print(f"\ncheckpoints cost {100 * (mean['checkpoints'] / mean['no checkpoints'] - 1):+.1f} % of the wall time (means of {args.rounds} each)")

    whole = runs["checkpoints"][0]["report"]
    reference = dict(_numbers(whole))
    rows = []
    for unit in filter(None, args.kills.split(",")):
        out, pause = scratch / f"killed-{len(rows)}", scratch / f"pause-{len(rows)}"
        killed = _run(_command(model, out), out.with_name(out.name + ".work"), {"SURGERY_PAUSE_AT": unit, "SURGERY_PAUSE_FILE": str(pause)}, pause)
        resumed = _run(_command(model, out), out.with_name(out.name + ".work"))
        mine = dict(_numbers(resumed["report"]))
        differ = [k for k in reference.keys() | mine.keys() if mine.get(k) != reference.get(k)]
        same = "yes" if not differ and (out / "model.onnx").read_bytes() == Path(whole["out"]).read_bytes() else f"NO: {len(differ)} differ {sorted(differ)[:3]}"
        rows.append({"killed at": unit, "ran before the kill": f"{killed['seconds']:.1f} s", "resume": f"{resumed['seconds']:.1f} s",
                     "run from scratch": f"{mean['checkpoints']:.1f} s", "saved": f"{100 * (1 - resumed['seconds'] / mean['checkpoints']):.0f} %",
                     "read back": ", ".join(f"{k} {v}" for k, v in resumed["report"]["resumed"].items()),
                     "output = uninterrupted": same})
        print(rows[-1], flush=True)
    if rows:
        print(table(rows, list(rows[0])))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
