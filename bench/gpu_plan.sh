#!/usr/bin/env bash
# The GPU rows still to run, by name, for a device call (bench/README.md, "Not run yet"): each row writes
# $OUT/ROW.json (bench/gpu_train.py's records; merge with `python bench/gpu_train.py --merge FILE...`) and
# $OUT/ROW.log. Build runs/gpu first (python bench/gpu_folder.py) and carry it.
#
#   OUT=$OUT bash bench/gpu_plan.sh n2z n2k        # on nvidia-h200-x2
#   OUT=$OUT bash bench/gpu_plan.sh zfull kada24   # on one GPU
#
# 2 GPUs (issue 46): n1 (one process through torchrun, Z-Image and Klein 4B), n2z / n2k (DDP scaling, target >= 0.9 x
# N), qwen / dev40 (the base sharded over two 24 / 40 GB caps), qstream (Qwen-Image streamed on one 24 GB cap, to
# compare), qrep (Qwen-Image replicated and streamed on each of two 24 GB caps, against qwen), fullz2 (Z-Image full
# fine-tune sharded, AdamW + EMA). 4 and 8 GPUs (issue 48): n4z, n4k, n8z, n8k, and dev4 (Flux2 Dev's base sharded on
# 4). One GPU: zfull (Z-Image full, AdamW + EMA, estimate ~95 GiB at checkpoint_budget 0), kada24 (Klein 4B full,
# Adafactor, a 24 GB cap, estimate 17.7 GiB). Fresh machines compile for 60-100 s a model: give a call of three rows
# 600 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-rows}
mkdir -p "$OUT"
E="env KILN_BENCH_TRACE=1 bash bench/gpu_env.sh"  # a failed row prints its traceback into ROW.log
G="$E python -m torch.distributed.run --standalone"
T="bench/gpu_train.py --no-native"
SHARDED="--baseline none --curve off --steps 20 --warmup 5"
FULL="--no-checkpoint --baseline none"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
status=0
for row in "$@"; do
  echo "=== $row $(date +%T)"
  case $row in
    n1) $G --nproc_per_node 1 $T --rows zimage:1024:1:on:default,klein4b:1024:1:on:default --out "$OUT/$row.json" ;;
    n[248]z) $G --nproc_per_node "${row:1:1}" $T --rows zimage:1024:1:on:default --out "$OUT/$row.json" ;;
    n[248]k) $G --nproc_per_node "${row:1:1}" $T --rows klein4b:1024:1:on:default --out "$OUT/$row.json" ;;
    dev4) $G --nproc_per_node 4 $T --rows dev:1024:1:on:default:host=on+sharding=shard --out "$OUT/$row.json" ;;
    qwen) $G --nproc_per_node 2 $T --rows qwen:1024:1:on:default:host=on+sharding=shard --card-gb 24 $SHARDED --out "$OUT/$row.json" ;;
    dev40) $G --nproc_per_node 2 $T --rows dev:1024:1:on:default:host=on+sharding=shard --card-gb 40 $SHARDED --out "$OUT/$row.json" ;;
    qrep) $G --nproc_per_node 2 $T --rows qwen:1024:1:on:default:host=on+sharding=replicate --card-gb 24 $SHARDED --out "$OUT/$row.json" ;;
    qstream) $E python $T --rows qwen:1024:1:on:default:host=on --card-gb 24 --steps 20 --warmup 5 --out "$OUT/$row.json" ;;
    fullz2) $G --nproc_per_node 2 $T --rows zimage:1024:1:on:default:adapter=full+sharding=shard+ema=true $FULL --out "$OUT/$row.json" ;;
    zfull) $E python $T --rows zimage:1024:1:on:default:adapter=full+ema=true --no-checkpoint --out "$OUT/$row.json" ;;
    kada24) $E python $T --rows klein4b:1024:1:on:default:adapter=full+optimizer=adafactor --card-gb 24 --no-checkpoint --out "$OUT/$row.json" ;;
    *) echo "unknown row $row (the rows: see this script's header)"; status=2; continue ;;
  esac > "$OUT/$row.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "rc $rc $(date +%T)"
  grep "^\[bench\]" "$OUT/$row.log" | tail -3 || tail -4 "$OUT/$row.log"
done
exit $status
