#!/usr/bin/env bash
# Here, before the first command to a lent GPU machine: the wheels the GPU suite needs and its image lacks
# (onnxruntime-gpu, built for CUDA 13; with --ray also ray and the jsonschema it needs), for that machine's Python (3.12),
# packed into one tar and split into parts that each fit one command (64 MiB a command, the checkout included), in
# ignored folders .gpu0 .. .gpuN at the repository root. benchmarks/RESULTS.md, "CUDA: how the suite runs on a lent GPU".
#
#   bash benchmarks/gpu-parts.sh [--ray]      # versions: the onnxruntime (and ray) installed here
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
ort_version=$(python3 -c 'import onnxruntime; print(onnxruntime.__version__)')
wheels=("onnxruntime-gpu==$ort_version")
if [ "${1:-}" = "--ray" ]; then
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
