"""A >= 4 GB Llama-shaped model end to end: peak RSS and seconds of inspect, parallelize and ablate.

    python benchmarks/big_model.py [--gb 4.2] [--dir out] [--fit-windows 2] [--seq-len 64] [--repeats 1]

Builds graphs/big_decoder.py's decoder (TinyLlama-1.1B shapes, random weights streamed to external
data) with at least --gb GB (1e9 bytes) of weights in a temporary folder under --dir, runs each
command in its own process under /usr/bin/time -v, prints one markdown table and removes every
file it made. Each command runs through a small wrapper that counts which external tensors the
process itself loads (onnx_ir maps a tensor's bytes in when something asks for its array): the
"weights read" column, what checks that a folding pass reads only the blocks it folds. Bytes that
ONNX Runtime reads (the compensation fit's sessions) and kernel copies (sendfile) are not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, table

from graphs import big_decoder

# Runs argv[3:] as `surgery ...` (kind cli) or compensate(model, {0: a random Fix}) (kind compensate) and
# writes to argv[1] the external tensors loaded into this process, name -> bytes.
WRAPPER = """
import atexit, json, sys
import onnx_ir._core as core
read, load = {}, core.ExternalTensor._load
def counted(self):
    read[self.name] = self.nbytes
    return load(self)
core.ExternalTensor._load = counted
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(read)))
kind, args = sys.argv[2], sys.argv[3:]
if kind == "cli":
    from surgery.cli import app
    app(args, prog_name="surgery")
else:
    import numpy as np
    from surgery import graph
    from surgery.facts import embedding_table
    from surgery.passes import Fix, compensate
    model = graph.load(args[0])
    d, rng = embedding_table(model)[1], np.random.default_rng(0)
    fix = Fix(0.01 * rng.standard_normal((d, d)), 0.01 * rng.standard_normal((d, d)), rng.standard_normal(d))
    graph.write(compensate(model, {0: fix}).model, args[1], like=args[0])
"""


def measure(kind: str, args: list[str], tmp: Path) -> dict:
    """Run one command under /usr/bin/time -v (kind cli, compensate, or cp: the copy alone); its wall
    seconds, peak RSS and the weights it loaded."""
    os.sync()  # the previous command's dirty pages are not this one's to write back
    counts = tmp / "read.json"
    counts.write_text("{}")
    command = ["cp", *args] if kind == "cp" else [sys.executable, "-c", WRAPPER, str(counts), kind, *args]
    cmd = ["/usr/bin/time", "-v", *command]
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{run.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    read = json.loads(counts.read_text())
    counts.unlink()
    return {"seconds": seconds, "rss": rss_kb * 1024, "read": read}


def folder_bytes(path: Path) -> int:
    """Bytes of the files in a folder (or of one file)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=4.2, help="at least this many GB (1e9 bytes) of weights")
    parser.add_argument("--dir", type=Path, default=ROOT / "out", help="where the temporary folder goes")
    parser.add_argument("--fit-windows", type=int, default=2, help="compensated row: calibration windows of the fit")
    parser.add_argument("--seq-len", type=int, default=64, help="compensated row: tokens per window")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each command: the fastest time and the largest RSS are shown")
    args = parser.parse_args()
    if not Path("/usr/bin/time").exists():
        raise SystemExit("needs /usr/bin/time (GNU time) for peak RSS: apt-get install time")
    layers = big_decoder.layers_for(args.gb * 1e9)
    args.dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="big-model-", dir=args.dir))
    try:
        model = tmp / "model"
        start = time.perf_counter()
        big_decoder.write(model, layers)
        built = time.perf_counter() - start
        size = folder_bytes(model)
        block_mb = big_decoder.block_bytes(**big_decoder.SHAPE) / 1e6
        print(f"built {layers} blocks, {size / 1e9:.2f} GB on disk ({block_mb:.0f} MB per block) in {built:.1f} s under {tmp}", file=sys.stderr)
        out = tmp / "out"
        rows = []
        runs = [
            ("`surgery --help` (the interpreter and imports alone)", "cli", ["--help"], False),
            ("`surgery inspect M`", "cli", ["inspect", str(model)], False),
            ("`cp M/model.onnx.data OUT` (the kernel copy every rewrite makes, alone)", "cp", [str(model / big_decoder.DATA), str(out)], True),
            ("`surgery parallelize M -o OUT --layers all` (plain)", "cli", ["parallelize", str(model), "-o", str(out), "--layers", "all"], True),
            ("`surgery ablate M --branch mlp --mode tangential --layers all -o OUT`", "cli", ["ablate", str(model), "--branch", "mlp", "--mode", "tangential", "--layers", "all", "-o", str(out)], True),
            ("`surgery parallelize M -o OUT --layers 0 --fuse` (folds 1 block)", "cli", ["parallelize", str(model), "-o", str(out), "--layers", "0", "--fuse"], True),
            (f"`surgery parallelize M -o OUT --layers all --fuse` (folds {layers} blocks)", "cli", ["parallelize", str(model), "-o", str(out), "--layers", "all", "--fuse"], True),
            ("`compensate(model, {0: fix})` + `graph.write` (library, fix given: folds 1 block)", "compensate", [str(model), str(out)], True),
            (
                f"`surgery parallelize M -o OUT --layers 0 --compensate --fit-windows {args.fit_windows} --seq-len {args.seq_len}` (fit in ONNX Runtime, folds 1 block)",
                "cli",
                ["parallelize", str(model), "-o", str(out), "--layers", "0", "--compensate", "--fit-windows", str(args.fit_windows), "--seq-len", str(args.seq_len), "--threads", str(os.cpu_count())],
                True,
            ),
        ]
        for label, kind, argv, writes in runs:
            print(f"running {label}", file=sys.stderr)
            tries = []
            for _ in range(args.repeats):
                tries.append(measure(kind, argv, tmp))
                output = folder_bytes(out)
                if out.is_file():
                    out.unlink()
                shutil.rmtree(out, ignore_errors=True)
            m = {"seconds": min(t["seconds"] for t in tries), "rss": max(t["rss"] for t in tries), "read": tries[0]["read"]}
            read = sum(m["read"].values())
            rows.append({
                "command": label,
                "seconds": f"{m['seconds']:.1f}",
                "peak RSS MB": f"{m['rss'] / 1e6:.0f}",
                "RSS / model bytes": f"{m['rss'] / size:.3f}",
                "s per GB": f"{m['seconds'] / (size / 1e9):.2f}",
                "weights read MB": f"{read / 1e6:.0f} ({len(m['read'])} tensors)" if m["read"] else "0",
                "output GB": f"{output / 1e9:.2f}" if writes else "-",
            })
        print(f"model: {layers} blocks of TinyLlama-1.1B shapes, {size / 1e9:.3f} GB on disk ({block_mb:.0f} MB per block); built in {built:.0f} s\n")
        print(table(rows, list(rows[0])))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
