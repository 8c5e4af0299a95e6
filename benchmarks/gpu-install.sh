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
# a real CUDA session on a one-node graph: where it cannot start, ORT says why (a CUDA library it cannot load) above this
PYTHONPATH=/tmp/site python3 -c 'import numpy as np, onnx, onnxruntime as o
from onnx import helper as h, TensorProto as T
g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "probe", [h.make_tensor_value_info("x", T.FLOAT, [4])], [h.make_tensor_value_info("y", T.FLOAT, [4])])
s = o.InferenceSession(h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=9).SerializeToString(), providers=["CUDAExecutionProvider"])
print("CUDA session:", s.get_providers(), s.run(None, {"x": np.array([-1, 0, 1, 2], np.float32)})[0])' || echo "CUDA session: cannot start (above: why)"
PYTHONPATH=/tmp/site python3 -c 'import ray; print("ray", ray.__version__)' 2>/dev/null || echo "ray: not carried"
