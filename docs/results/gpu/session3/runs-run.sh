#!/usr/bin/env bash
# Third GPU run, third part: the cells a fate reads or writes in device memory go in runs (cells at most 64 KiB apart
# share one transfer) instead of one span from the lowest to the highest cell; the kit as in full-model-run.sh.
set -u
B=/tmp/pykvcache-cuda-build
[ -x $B/kvbench ] || STEPS=0 bash scripts/gpu-session.sh > /dev/null
cat .gpukit/full.gguf.part-* > /tmp/full.gguf
[ "$(md5sum < /tmp/full.gguf | cut -c1-32)" = "$(cat .gpukit/full.md5)" ] || { echo "model parts incomplete"; ls -la .gpukit; exit 1; }
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
export LD_LIBRARY_PATH=$B/bin:$(dirname $(find $CUDA_ROOT/ -name 'libcudart.so.*' | head -1)):$(python3 -c "import nvidia; print(nvidia.__path__[0])")/cu13/lib
M=/tmp/full.gguf; T=.gpukit/text.txt; L=$OUT/runs.log
T0=$(date +%s); say() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a $L; }
nvidia-smi -L | tee $L; nvcc --version | tail -2 >> $L
timeout 150 $B/kvbench -m $M -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json --no-limit -f $T --policy full \
  --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise --policy entropy:budget=0.1+summarise \
  --policy freeze > $OUT/runs-kvbench-n64.json 2>> $L; say "n64 rc=$?"
timeout 120 $B/kvp-backend-check -m $M -f $T -p 4096 -n 32 -t 16 > $OUT/runs-kvp-backend-check.json 2>> $L; say "check rc=$?"
