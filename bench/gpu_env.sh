#!/usr/bin/env bash
# On a GPU machine without a package index: unpack runs/gpu/ (built by bench/gpu_folder.py) and run a command
# with ComfyUI's tree and the carried packages on the path.
#   bash bench/gpu_env.sh python bench/gpu_train.py --rows zimage:1024:1:on:default --out $OUT/r.json
#   bash bench/gpu_env.sh bash bench/gpu_node_tests.sh
# Sets COMFYUI_PATH (the tree), PYTHONPATH (the carried site folder after the checkout) and KILN_COMMIT (the
# commit the carried code was stamped with), so records name the code they timed.
set -euo pipefail
cd "$(dirname "$0")/.."
folder=runs/gpu
[ -f "$folder/kiln-gpu.tar.xz" ] || { echo "$folder/kiln-gpu.tar.xz missing: run python bench/gpu_folder.py here first and carry runs/gpu" >&2; exit 2; }
unpacked=${KILN_GPU_DIR:-/tmp/kiln-gpu}
if [ "$(cat "$unpacked/fingerprint.txt" 2>/dev/null)" != "$(cat "$folder/fingerprint.txt")" ]; then
  rm -rf "$unpacked"; mkdir -p "$unpacked"
  tar -xJf "$folder/kiln-gpu.tar.xz" -C "$unpacked"
  cp "$folder/fingerprint.txt" "$unpacked/"
fi
export COMFYUI_PATH=$unpacked/comfyui
export PYTHONPATH=$PWD:$unpacked/site${PYTHONPATH:+:$PYTHONPATH}
export KILN_COMMIT=$(cat "$folder/commit.txt")
exec "$@"
