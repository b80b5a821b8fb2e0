#!/usr/bin/env bash
# the whole SmolLM2-135M (30 layers) on the GPU: carried in two parts over two calls (see docs/NOTES.md, CUDA)
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
nvidia-smi -L > $OUT/full.log
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json -f $T --policy full \
  --policy sink_recent:n_sink=4,n_recent=815 --policy snapkv:budget=0.1 --policy h2o:budget=0.1 --policy pyramid:budget=0.1 \
  --policy entropy:budget=0.1 > $OUT/full-kvbench-policies.json 2>> $OUT/full.log; echo "policies rc=$?" | tee -a $OUT/full.log
timeout 100 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json --no-limit -f $T --policy full \
  --policy snapkv:budget=0.1+summarise --policy freeze > $OUT/full-kvbench-fates.json 2>> $OUT/full.log; echo "fates rc=$?" | tee -a $OUT/full.log
timeout 200 $B/kvp-backend-check -m $M -f $T -p 4096 -n 32 -t 16 > $OUT/full-kvp-backend-check.json 2>> $OUT/full.log; echo "check rc=$?" | tee -a $OUT/full.log
