#!/usr/bin/env bash
# The GPU suite in one command, on the lent GPU machine, from the repository root, after the commands before it copied
# the parts of benchmarks/gpu-parts.sh to /tmp/gpuparts (benchmarks/RESULTS.md, "CUDA: how the suite runs on a lent GPU"):
# installs the carried wheels into /tmp/site (benchmarks/gpu-install.sh), then runs
#   1. benchmarks/cuda.py: ORT latency of original / plain / fused / compensated / fused compensated graphs of a float16
#      Llama-3.2-1B-shaped decoder, the later half and all blocks, batch 1, 8, 32, as ORT runs them and as CUDA graphs;
#   2. benchmarks/cuda_torch.py: the same block forms in PyTorch, eager and CUDA-graph replay, on the same weights;
#   3. benchmarks/cuda_equal.py --ray: surgery's evaluation on CUDA against the CPU, and diagnose on a Ray GPU actor
#      against this process (--ray only when ray was carried).
# Each step has its own time limit, so one that hangs leaves the others their time; tables (.md) and logs go to $OUT
# (out/gpu without it) as they are made. --smoke runs the whole suite on the CPU with tiny shapes (no install).
#   bash benchmarks/gpu.sh [--smoke]
set -uo pipefail
out=${OUT:-out/gpu}
mkdir -p "$out"
smoke=()
if [ "${1:-}" = "--smoke" ]; then
  smoke=(--smoke)
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  # the CUDA 13 libraries onnxruntime-gpu loads (cuBLAS, cuDNN, ...) are the image's nvidia pip packages, beside its
  # PyTorch: on the loader's path, as the carried onnxruntime in /tmp/site does not look there
  nvidia_libs=$(python3 -c 'import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations) if spec else []
print(":".join(sorted({os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "**", "lib*.so*"), recursive=True)})))')
  export LD_LIBRARY_PATH=$nvidia_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  bash benchmarks/gpu-install.sh > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
  cat "$out/install.log"
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
fi
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
status=0
step() {  # step NAME LIMIT_S SCRIPT ARGS...: its table to $OUT/NAME.md, its log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$python" "$@" "${smoke[@]}" > "$out/$name.md" 2> "$out/$name.log"
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - start)) s"
  cat "$out/$name.md"
  [ "$rc" = 0 ] || { tail -5 "$out/$name.log"; status=1; }
}
step cuda 330 benchmarks/cuda.py --shape 1b --dtype float16 --repeats 15 --warmup 3
step cuda-torch 120 benchmarks/cuda_torch.py --shape 1b --dtype float16 --repeats 15 --warmup 3
ray=()
"$python" -c 'import ray' 2>/dev/null && ray=(--ray)
step cuda-equal 90 benchmarks/cuda_equal.py "${ray[@]}"
exit $status
