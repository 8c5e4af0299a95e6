#!/usr/bin/env bash
# On the GPU machine: joins the parts that earlier commands copied to /tmp/ortgpu, checks the
# wheel's sha256, and installs it into /tmp/site. Then: export PYTHONPATH=/tmp/site:$PWD
# (run by benchmarks/gpu.sh; it travels with the checkout)
set -euo pipefail
cd /tmp/ortgpu
name=$(cat NAME); cat part.* > "$name"
[ "$(sha256sum "$name" | cut -d' ' -f1)" = "$(cat SHA256)" ] || { echo "parts missing or damaged: $(ls part.* | tr '\n' ' ')"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$name"
PYTHONPATH=/tmp/site python3 -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())'
