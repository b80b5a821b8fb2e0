#!/usr/bin/env bash
# the scheduler's splits and their inputs for a decode step: full cache against the per-layer memory (8-layer kit model)
B=/tmp/pykvcache-cuda-build
[ -x $B/kvbench ] || STEPS=0 bash scripts/gpu-session.sh > /dev/null
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
export LD_LIBRARY_PATH=$B/bin:$(dirname $(find $CUDA_ROOT/ -name 'libcudart.so.*' | head -1)):$(python3 -c "import nvidia; print(nvidia.__path__[0])")/cu13/lib
M=$(ls .gpukit/*.gguf | head -1)
for pol in full sink_recent:n_sink=4,n_recent=100; do
  echo "== $pol" >> $OUT/sched.txt
  GGML_SCHED_DEBUG=1 timeout 60 $B/kvbench -v -m $M -ngl 99 -t 16 -p 256 -n 4 -r 1 --no-limit -f .gpukit/text.txt --policy $pol > $OUT/raw-$(echo $pol | cut -c1-4).log 2>&1
  grep "SPLIT" $OUT/raw-$(echo $pol | cut -c1-4).log | sort | uniq -c | sort -rn | head -20 | cut -c1-3000 >> $OUT/sched.txt
done
ls -la $OUT
