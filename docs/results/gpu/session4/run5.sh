#!/usr/bin/env bash
# Fourth GPU run, fifth part: after summarise's query entropies (its `lam` ordering) are computed for every layer at
# once on the context's threads (the host's 16 cores are idle while the GPU decodes), the lam comparison of run4.sh
# again, with entropy too; the kit rebuilt with this checkout's libllama. That change showed no gain beyond the noise
# between repetitions (lam=0 352 +- 37 t/s, default 316 +- 15) and was not committed: the libllama of this run is
# 67b7e31 plus it.
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/run5.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L
timeout 200 $B/kvbench -m $M -ngl 99 -t 16 -p 4096 -n 256 -r 3 -o json --no-limit -f $T \
  --policy snapkv:budget=0.1+summarise:lam=0 --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise \
  --policy entropy:budget=0.1 --policy entropy:budget=0.1+summarise > $OUT/kvbench-lam-threads.json 2>> $L; say "rc=$?"
