#!/usr/bin/env bash
# Kiln's ComfyUI tests on a GPU, as users run Kiln: ComfyUI on its GPU (KILN_COMFY_GPU=1: no --cpu, the
# nodes' device auto and bf16, so Kiln's defaults: compiled blocks, step graphs, the auto budget), the node
# graph in process, headless `train`, and a live ComfyUI server running each example workflow through
# comfy-cli. Tests that compare two runs bit for bit do it under deterministic kernels (tests/nodes/
# conftest.py, same_kernels), which need cuBLAS's fixed workspace from the start of the process.
#
#   COMFYUI_PATH=/path/to/ComfyUI bash bench/gpu_node_tests.sh [pytest args, e.g. -k resume]
#
# Needs ComfyUI's requirements (its server: sqlalchemy, alembic, pydantic, the frontend package) and Kiln's
# `test` extra (pytest, comfy-cli) in the Python that runs it. Results: bench/RESULTS.md, "The node pack on
# CUDA with Kiln's defaults".
set -o pipefail
: "${COMFYUI_PATH:?set COMFYUI_PATH to a ComfyUI tree}"
export KILN_COMFY_GPU=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 DO_NOT_TRACK=1
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" -m pytest -q -rfE --comfyui only --durations=10 \
  tests/nodes/test_server.py tests/nodes/test_nodes.py tests/test_headless.py tests/nodes/test_node_faults.py \
  tests/nodes/comfy/test_compiled_blocks.py tests/nodes/test_node_reliability.py "$@"
