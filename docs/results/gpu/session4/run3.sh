#!/usr/bin/env bash
# Fourth GPU run, third part: is summarise's decode gap on the GPU its `lam` ordering (the query entropies read from
# the device at every eviction)? The same kit as run.sh; lam=0 orders the leavers by score alone.
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/run3.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L
timeout 120 $B/kvbench -m $M -ngl 99 -t 16 -p 4096 -n 256 -r 2 -o json --no-limit -f $T --policy snapkv:budget=0.1 \
  --policy snapkv:budget=0.1+summarise --policy snapkv:budget=0.1+summarise:lam=0 --policy h2o:budget=0.1 \
  --policy h2o:budget=0.1+summarise --policy h2o:budget=0.1+summarise:lam=0 > $OUT/kvbench-lam.json 2>> $L; say "lam rc=$?"
