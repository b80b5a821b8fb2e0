#!/usr/bin/env bash
# Fourth GPU run, second part: where summarise's decode time goes with every layer on the GPU (kvbench's new
# sum_ms_pp / sum_ms_tg: the fate's host time reading leavers, fitting and writing centroids), over 512 decode steps,
# and the same on this machine's CPU (-ngl 0, 16 threads) for the transfer cost; the kit as in run.sh.
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/run2.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 512 -r 1 -o json -f $T --policy full --policy snapkv:budget=0.1 \
  --policy snapkv:budget=0.1+summarise --policy entropy:budget=0.1 --policy entropy:budget=0.1+summarise \
  > $OUT/kvbench-gpu-n512.json 2>> $L; say "gpu n512 rc=$?"
timeout 150 $B/kvbench -m $M -ngl 0 -t 16 -p 4096 -n 256 -r 1 -o json -f $T --policy full --policy snapkv:budget=0.1 \
  --policy snapkv:budget=0.1+summarise > $OUT/kvbench-cpu16-n256.json 2>> $L; say "cpu n256 rc=$?"
timeout 60 $B/kvbench -m $M -ngl 99 -t 16 -p 4096 -n 256 -r 1 -o json -f $T --policy full --policy snapkv:budget=0.1 \
  --policy snapkv:budget=0.1+summarise > $OUT/kvbench-gpu-n256.json 2>> $L; say "gpu n256 rc=$?"
for pol in snapkv:budget=0.1 snapkv:budget=0.1+summarise; do
  echo "== $pol" >> $OUT/sched.txt
  GGML_SCHED_DEBUG=1 timeout 60 $B/kvbench -v -m $M -ngl 99 -t 16 -p 512 -n 4 -r 1 --no-limit -f $T --policy $pol 2>&1 \
    | grep -E "SPLIT|inputs" | sed 's/\(.\{300\}\).*/\1.../' | sort | uniq -c | sort -rn | head -12 >> $OUT/sched.txt
done
say "sched done"
