#!/usr/bin/env bash
# Fourth GPU run (2026-11-27): the whole SmolLM2-135M (30 layers) at 2f9e048, the first with KV cache types other than
# f16 on CUDA. The kit: .gpukit/cuda-bin.tar.xz (scripts/check-cuda.sh --full --arch 90 here, then
# scripts/gpu-kit.sh --prebuilt), the model in three parts over three calls on one warm machine, the essays text.
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/run.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L; nvcc --version 2>/dev/null | tail -1 >> $L
# 1. the retention policies and summarise, every layer on the GPU, 8k prompt, 10%, f16 caches
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json -f $T --policy full \
  --policy sink_recent:n_sink=4,n_recent=815 --policy snapkv:budget=0.1 --policy entropy:budget=0.1 \
  --policy h2o:budget=0.1 --policy snapkv:budget=0.1+summarise --policy entropy:budget=0.1+summarise \
  > $OUT/kvbench-f16.json 2>> $L; say "f16 rc=$?"
# 2. quantized caches on CUDA: q8_0 K and V, and q8_0 K with f16 V (two types: pykvcache's op falls back)
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json -f $T -ctk q8_0 -ctv q8_0,f16 --policy full \
  --policy snapkv:budget=0.1 --policy entropy:budget=0.1 --policy h2o:budget=0.1 \
  --policy snapkv:budget=0.1+summarise > $OUT/kvbench-q8.json 2>> $L; say "q8 rc=$?"
# 3. the engine across backends with the real model: every preset on the CPU against every layer on CUDA
timeout 120 $B/kvp-backend-check -m $M -f $T -p 4096 -n 32 -t 16 > $OUT/kvp-backend-check.json 2>> $L; say "check rc=$?"
