#!/usr/bin/env bash
# Third GPU run, second part: summarise after its fits moved to one parallel pass over every layer's closed bins
# (after_evictions), on the whole model; the kit as in full-model-run.sh (libllama of this checkout).
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/summarise.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L; nvcc --version | tail -2 >> $L
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json --no-limit -f $T --policy full \
  --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise --policy entropy:budget=0.1 \
  --policy entropy:budget=0.1+summarise > $OUT/summarise-kvbench-n64.json 2>> $L; say "n64 rc=$?"
timeout 120 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 512 -r 1 -o json --no-limit -f $T --policy full \
  --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise > $OUT/summarise-kvbench-n512.json 2>> $L; say "n512 rc=$?"
timeout 150 $B/kvp-backend-check -m $M -f $T -p 4096 -n 32 -t 16 > $OUT/summarise-kvp-backend-check.json 2>> $L; say "check rc=$?"
