#!/usr/bin/env bash
# Fourth GPU run, fourth part: run3.sh's lam effect again with three repetitions, the order of the policies changed,
# to tell it from the noise between repetitions; the same kit.
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/run4.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L
(command -v perf nsys; ls /usr/local/cuda/bin 2>/dev/null | grep -i -E "nsys|ncu") >> $L 2>&1
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 4096 -n 256 -r 3 -o json --no-limit -f $T \
  --policy snapkv:budget=0.1+summarise:lam=0 --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise \
  --policy snapkv:budget=0.1+summarise:lam=1 > $OUT/kvbench-lam-r3.json 2>> $L; say "lam r3 rc=$?"
