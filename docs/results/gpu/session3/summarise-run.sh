#!/usr/bin/env bash
# Third GPU run, second part: summarise after its fits moved to one parallel pass over every layer's closed bins
# (after_evictions), on the whole model; the kit as in full-model-run.sh (libllama of this checkout).
set -u
B=/tmp/pykvcache-cuda-build
[ -x $B/kvbench ] || STEPS=0 bash scripts/gpu-session.sh > /dev/null
cat .gpukit/full.gguf.part-* > /tmp/full.gguf
[ "$(md5sum < /tmp/full.gguf | cut -c1-32)" = "$(cat .gpukit/full.md5)" ] || { echo "model parts incomplete"; ls -la .gpukit; exit 1; }
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
export LD_LIBRARY_PATH=$B/bin:$(dirname $(find $CUDA_ROOT/ -name 'libcudart.so.*' | head -1)):$(python3 -c "import nvidia; print(nvidia.__path__[0])")/cu13/lib
M=/tmp/full.gguf; T=.gpukit/text.txt; L=$OUT/summarise.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L; nvcc --version | tail -2 >> $L
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json --no-limit -f $T --policy full \
  --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise --policy entropy:budget=0.1 \
  --policy entropy:budget=0.1+summarise > $OUT/summarise-kvbench-n64.json 2>> $L; say "n64 rc=$?"
timeout 120 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 512 -r 1 -o json --no-limit -f $T --policy full \
  --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise > $OUT/summarise-kvbench-n512.json 2>> $L; say "n512 rc=$?"
timeout 150 $B/kvp-backend-check -m $M -f $T -p 4096 -n 32 -t 16 > $OUT/summarise-kvp-backend-check.json 2>> $L; say "check rc=$?"
