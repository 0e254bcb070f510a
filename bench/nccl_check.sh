#!/bin/bash
# Usage (a machine with 2 GPUs): OUT=/tmp/out bash bench/nccl_check.sh
# Two ranks on two GPUs over NCCL train what one process with the doubled batch trains (demo arch).
set -u
cd "$(dirname "$0")/.."
python3 -c "from trainer.demo.run import make_dataset; make_dataset('/tmp/shapes')" || exit 1
conf() { printf 'arch = "demo"\ndevice = "cuda"\nmixed_precision = "no"\nsteps = 40\nbatch_size = %s\nrank = 8\nalpha = 8.0\nresolutions = [128]\ncheckpoint_every = 20\nlog_every = 10\ncompile_blocks = false\ncaption_dropout = 0.1\nema = true\ndataset_dir = "/tmp/shapes"\noutput_dir = "/tmp/runs"\nrun_name = "%s"\n' "$1" "$2" > /tmp/$2.toml; }
conf 2 nccl; conf 4 single
nvidia-smi --query-gpu=name --format=csv,noheader
SECONDS=0; timeout 150 torchrun --standalone --nproc_per_node 2 -m trainer train /tmp/nccl.toml > $OUT/nccl.log 2>&1; echo "torchrun rc=$? ${SECONDS} s"
SECONDS=0; timeout 100 python3 -m trainer train /tmp/single.toml > $OUT/single.log 2>&1; echo "single rc=$? ${SECONDS} s"
tail -4 $OUT/nccl.log; tail -2 $OUT/single.log
python3 - <<'PY'
import glob
from safetensors.torch import load_file
def last(run):
    files = sorted(glob.glob(f"/tmp/runs/{run}/step-*/lora.safetensors")); print(run, files); return load_file(files[-1])
a, b = last("nccl"), last("single")
worst = max(float((a[k].float() - b[k].float()).abs().max() / (b[k].float().abs().max() + 1e-12)) for k in b if k.endswith(".weight"))
moved = max(float(b[k].float().abs().max()) for k in b if "lora_B" in k)
print("largest |B| after training:", moved)
print("keys equal:", set(a) == set(b), "worst relative difference:", worst)
PY
