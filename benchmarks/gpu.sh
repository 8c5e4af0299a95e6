#!/usr/bin/env bash
# The GPU suite in one command, on the GPU machine, from the repository root, after the commands before it copied
# the onnxruntime-gpu wheel's parts to /tmp/ortgpu (benchmarks/RESULTS.md, "CUDA: how the suite runs on a lent GPU"):
# installs the wheel into /tmp/site, then runs benchmarks/cuda.py on a float16 Llama-3.2-1B-shaped decoder
# (original / plain / fused / compensated / fused compensated, the later half and all blocks, batch 1, 8, 32), and
# benchmarks/cuda_equal.py (surgery's evaluation on CUDA against the CPU on the tiny fixtures).
# Tables and logs go to $OUT (out/gpu without it).   bash benchmarks/gpu.sh [extra cuda.py arguments]
set -euo pipefail
out=${OUT:-out/gpu}
mkdir -p "$out"
bash benchmarks/ort-gpu-install.sh > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
status=0
python3 benchmarks/cuda_equal.py > "$out/cuda-equal.md" 2>&1 || status=$?
cat "$out/cuda-equal.md"
python3 benchmarks/cuda.py --shape 1b --dtype float16 "$@" > "$out/cuda-1b-float16.md" 2> "$out/cuda-1b-float16.log" || status=$((status + $?))
cat "$out/cuda-1b-float16.md"
tail -5 "$out/cuda-1b-float16.log"
exit $status
