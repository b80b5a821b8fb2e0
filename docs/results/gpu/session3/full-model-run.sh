#!/usr/bin/env bash
# Third GPU run: the whole SmolLM2-135M (30 layers) after the packed graph inputs (a9edecd) and summarise's new default.
# The kit: .gpukit/cuda-bin.tar.xz (the earlier CUDA ggml libraries, whose sources are unchanged, with libllama and the
# tools of this checkout), the model in three parts (carried over three calls on one warm machine), the essays text.
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/full.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L
# 1. the scheduler's splits of a decode step on the real device: inputs per split (the full cache has 6)
for pol in full sink_recent:n_sink=4,n_recent=100 entropy:budget=128; do
  echo "== $pol" >> $OUT/sched.txt
  GGML_SCHED_DEBUG=1 timeout 60 $B/kvbench -v -m $M -ngl 99 -t 16 -p 256 -n 4 -r 1 --no-limit -f $T --policy $pol 2>&1 \
    | grep -E "SPLIT|inputs" | sed 's/\(.\{300\}\).*/\1.../' | sort | uniq -c | sort -rn | head -12 >> $OUT/sched.txt
done
say "sched done"
# 2. the retention policies, every layer on the GPU, 8k prompt, 10%
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 3 -o json -f $T --policy full \
  --policy sink_recent:n_sink=4,n_recent=815 --policy snapkv:budget=0.1 --policy h2o:budget=0.1 --policy pyramid:budget=0.1 \
  --policy entropy:budget=0.1 > $OUT/full-kvbench-policies.json 2>> $L; say "policies rc=$?"
# 3. the fates that move K/V between the GPU and the host; the freeze with one graph per step (every=1) against its
#    default (every=4: two graphs alternate)
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json --no-limit -f $T --policy full \
  --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise --policy entropy:budget=0.1+summarise \
  --policy freeze --policy freeze:every=1 > $OUT/full-kvbench-fates.json 2>> $L; say "fates rc=$?"
# 4. the engine across backends with the real model: every preset on the CPU against every layer on CUDA
timeout 200 $B/kvp-backend-check -m $M -f $T -p 4096 -n 32 -t 16 > $OUT/full-kvp-backend-check.json 2>> $L; say "check rc=$?"
# 5. half the layers on the GPU (the consumer-GPU case), if time is left
timeout 90 $B/kvbench -m $M -ngl 15 -t 16 -p 8192 -n 64 -r 2 -o json -f $T --policy full \
  --policy sink_recent:n_sink=4,n_recent=815 --policy entropy:budget=0.1 > $OUT/full-kvbench-ngl15.json 2>> $L; say "ngl15 rc=$?"
