#!/usr/bin/env bash
# On the GPU machine (run by benchmarks/gpu.sh): joins the parts that earlier commands copied to /tmp/gpuparts
# (benchmarks/gpu-parts.sh made them), checks the tar's sha256, and installs its wheels into /tmp/site.
# Then: export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd /tmp/gpuparts
cat part.* > wheels.tar
[ "$(sha256sum wheels.tar | cut -d' ' -f1)" = "$(cat SHA256)" ] || { echo "parts missing or damaged: $(ls part.* | tr '\n' ' ')"; exit 1; }
tar -xf wheels.tar
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl
PYTHONPATH=/tmp/site python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())'
PYTHONPATH=/tmp/site python3 -c 'import ray; print("ray", ray.__version__)' 2>/dev/null || echo "ray: not carried"
