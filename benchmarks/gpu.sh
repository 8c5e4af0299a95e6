#!/usr/bin/env bash
# The GPU suite, from the repository root (benchmarks/RESULTS.md, "CUDA: how the suite runs on a lent GPU"):
#   bash benchmarks/gpu.sh --parts [--ray]   # here, before the first command to a lent GPU machine: the wheels the suite needs
#                                            # and the image lacks (onnxruntime-gpu for CUDA 13; with --ray also ray and the
#                                            # jsonschema it needs), for that machine's Python (3.12), packed into one tar and
#                                            # split into ignored folders .gpu0 .. .gpuN that each fit one command (64 MiB a
#                                            # command, the checkout included); versions: the onnxruntime (and ray) installed here
#   bash benchmarks/gpu.sh                   # on the GPU machine, after earlier commands copied the parts to /tmp/gpuparts:
#                                            # joins them, checks the tar's sha256, installs its wheels into /tmp/site, starts
#                                            # one CUDA session (or prints ORT's reason), then runs the three steps below
#   bash benchmarks/gpu.sh --smoke           # the whole suite on the CPU with tiny shapes (no install)
# The steps:
#   1. benchmarks/cuda.py: ORT latency of original / plain / fused / compensated / fused compensated graphs of a float16
#      Llama-3.2-1B-shaped decoder, the later half and all blocks, batch 1, 8, 32, as ORT runs them and as CUDA graphs;
#   2. benchmarks/cuda_torch.py: the same block forms in PyTorch, eager and CUDA-graph replay, on the same weights;
#   3. benchmarks/cuda_equal.py --ray: surgery's evaluation on CUDA against the CPU, and diagnose on a Ray GPU actor
#      against this process (--ray only when ray was carried).
# Each step has its own time limit, so one that hangs leaves the others their time; tables (.md) and logs go to $OUT
# (out/gpu without it) as they are made.
set -uo pipefail

parts() {  # --parts: the carried wheels, in parts
  set -e
  root=$(git rev-parse --show-toplevel); cd "$root"
  ort_version=$(python3 -c 'import onnxruntime; print(onnxruntime.__version__)')
  wheels=("onnxruntime-gpu==$ort_version")
  if [ "${2:-}" = "--ray" ]; then
    wheels+=("ray==$(python3 -c 'import ray; print(ray.__version__)')" jsonschema jsonschema-specifications referencing rpds-py)
  fi
  mkdir -p .git/info
  grep -qxF '/.gpu[0-9]*/' .git/info/exclude 2>/dev/null || echo '/.gpu[0-9]*/' >> .git/info/exclude
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir "$tmp/wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$tmp/wheels" "${wheels[@]}"
  tar -cf "$tmp/wheels.tar" -C "$tmp" wheels
  tree_mb=$(( ($(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) + 1048575) / 1048576 ))
  part_mb=$(( 62 - tree_mb ))
  [ "$part_mb" -ge 16 ] || { echo "the checkout alone is ${tree_mb} MiB: too little room left for a part"; exit 1; }
  rm -rf .gpu[0-9]*/
  split -b "${part_mb}M" -d -a 1 "$tmp/wheels.tar" "$tmp/part."
  for p in "$tmp"/part.*; do n=${p##*.}; mkdir -p ".gpu$n"; mv "$p" ".gpu$n/"; done
  sha256sum "$tmp/wheels.tar" | cut -d' ' -f1 > .gpu0/SHA256
  n=$(ls -d .gpu[0-9]*/ | wc -l)
  echo "$(ls "$tmp/wheels" | tr '\n' ' ')in $n parts of <= ${part_mb} MiB (checkout ${tree_mb} MiB): $(ls -d .gpu[0-9]*/ | tr '\n' ' ')"
}

install() {  # on the GPU machine: the parts joined, checked and installed into /tmp/site; then: export PYTHONPATH=/tmp/site:$PWD
  set -e
  cd /tmp/gpuparts
  cat part.* > wheels.tar
  [ "$(sha256sum wheels.tar | cut -d' ' -f1)" = "$(cat SHA256)" ] || { echo "parts missing or damaged: $(ls part.* | tr '\n' ' ')"; exit 1; }
  tar -xf wheels.tar
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl
  PYTHONPATH=/tmp/site python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())'
  # a real CUDA session on a one-node graph: where it cannot start, ORT says why (a CUDA library it cannot load) above this
  PYTHONPATH=/tmp/site python3 -c 'import numpy as np, onnx, onnxruntime as o
  from onnx import helper as h, TensorProto as T
  g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "probe", [h.make_tensor_value_info("x", T.FLOAT, [4])], [h.make_tensor_value_info("y", T.FLOAT, [4])])
  s = o.InferenceSession(h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=9).SerializeToString(), providers=["CUDAExecutionProvider"])
  print("CUDA session:", s.get_providers(), s.run(None, {"x": np.array([-1, 0, 1, 2], np.float32)})[0])' || echo "CUDA session: cannot start (above: why)"
  PYTHONPATH=/tmp/site python3 -c 'import ray; print("ray", ray.__version__)' 2>/dev/null || echo "ray: not carried"
}

if [ "${1:-}" = "--parts" ]; then
  parts "$@"
  exit
fi
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
  (install) > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
  cat "$out/install.log"
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
fi
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
status=0
step() {  # step NAME LIMIT_S SCRIPT ARGS...: its table to $OUT/NAME.md, its log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  [ ${#smoke[@]} -gt 0 ] && limit=$((limit * 5))  # --smoke checks the steps run, on a CPU that may be busy: no race against a GPU's budget
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
