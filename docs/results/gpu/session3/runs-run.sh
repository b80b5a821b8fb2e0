#!/usr/bin/env bash
# Third GPU run, third part: the cells a fate reads or writes in device memory go in runs (cells at most 64 KiB apart
# share one transfer) instead of one span from the lowest to the highest cell; the kit as in full-model-run.sh.
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/runs.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L; nvcc --version | tail -2 >> $L
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json --no-limit -f $T --policy full \
  --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise --policy entropy:budget=0.1+summarise \
  --policy freeze > $OUT/runs-kvbench-n64.json 2>> $L; say "n64 rc=$?"
timeout 120 $B/kvp-backend-check -m $M -f $T -p 4096 -n 32 -t 16 > $OUT/runs-kvp-backend-check.json 2>> $L; say "check rc=$?"
