#!/usr/bin/env bash
# For the next GPU session (prepared 2026-11-27 without a GPU, not run yet): summarise's decode against eviction by
# the same policy with every layer on the GPU, after summarise's device reads became one gather per eviction pass
# (llama-kvp-gather.cpp). Issue 14 asks >= 0.9x of eviction's decode; the fourth run measured 0.60-0.74x (H200),
# with ~0.25 ms a token of leaver reads and 0.3-0.5 ms a step of the lam ordering. Flash attention on (kvbench's
# default) and off (llama-cpp-python's default: a transposed V, which summarise read element by element before).
# Run with the kit of docs/results/gpu/NOTE.md (scripts/gpu-kit.sh, the whole model in three parts). kvbench's JSON
# now carries the policy's own host time per decoded token by part (host_ms_tg, host_ms_tg_parts: prepare, slots,
# inputs, settle; llama_kvp_perf), so each row says how much of its step is the policy's host work and how much the
# device's: bench/gpu_results.py prints it beside the speeds. Since the 30th session the time the policy waited in it for
# the device's earlier graphs is apart (host_wait_ms_pp / host_wait_ms_tg), so host work and device compute separate.
set -u
source scripts/gpu-full-model.sh  # the kit's binaries, the joined model (B, M, T, LD_LIBRARY_PATH)
L=$OUT/run.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L
for fa in on off; do
  timeout 200 $B/kvbench -m $M -ngl 99 -t 16 -p 4096 -n 256 -r 3 -fa $fa -o json -f $T --policy snapkv:budget=0.1 \
    --policy snapkv:budget=0.1+summarise --policy snapkv:budget=0.1+summarise:lam=0 --policy entropy:budget=0.1 \
    --policy entropy:budget=0.1+summarise > $OUT/kvbench-fa-$fa.json 2>> $L; say "fa=$fa rc=$?"
done
# the same on the machine's CPU (-ngl 0), for the fate's own host time without device transfers
timeout 150 $B/kvbench -m $M -ngl 0 -t 16 -p 4096 -n 256 -r 2 -o json --no-limit -f $T --policy snapkv:budget=0.1 \
  --policy snapkv:budget=0.1+summarise > $OUT/kvbench-cpu.json 2>> $L; say "cpu rc=$?"
# the freeze preset (7.7-8.0 t/s at 8k in the third run, cause open): its host time per token after the 30th session's
# cheaper cell moves, and how much of its step is waiting for the device (host_wait_ms_tg)
timeout 120 $B/kvbench -m $M -ngl 99 -t 16 -p 4096 -n 64 -r 1 -o json --no-limit -f $T --policy freeze \
  > $OUT/kvbench-freeze.json 2>> $L; say "freeze rc=$?"
