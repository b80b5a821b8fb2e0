#!/usr/bin/env bash
# Sourced by a GPU run script on the device, after the kit and the whole model's parts were carried (docs/NOTES.md,
# CUDA: the model goes in parts over calls on one warm machine):
#
#   source scripts/gpu-full-model.sh
#
# unpacks the kit's binaries where no earlier call did, joins .gpukit/full.gguf.part-* into /tmp/full.gguf and checks
# it against .gpukit/full.md5 (exits if a part is missing), and sets B (the binaries), M (the model), T (the essays
# text) and LD_LIBRARY_PATH (the kit's libraries, the CUDA runtime and cuBLAS).
B=/tmp/pykvcache-cuda-build
[ -x $B/kvbench ] || STEPS=0 bash scripts/gpu-session.sh > /dev/null
cat .gpukit/full.gguf.part-* > /tmp/full.gguf
[ "$(md5sum < /tmp/full.gguf | cut -c1-32)" = "$(cat .gpukit/full.md5)" ] || { echo "model parts incomplete"; ls -la .gpukit; exit 1; }
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
export LD_LIBRARY_PATH=$B/bin:$(dirname $(find $CUDA_ROOT/ -name 'libcudart.so.*' | head -1)):$(python3 -c "import nvidia; print(nvidia.__path__[0])")/cu13/lib
M=/tmp/full.gguf
T=.gpukit/text.txt
