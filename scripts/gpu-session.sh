#!/usr/bin/env bash
# The CUDA checks of a GPU session, in one command on the device machine (after `bash scripts/gpu-kit.sh` here):
#
#   run(command="bash scripts/gpu-session.sh", carry=[".gpukit"], timeout_s=600)
#   run(command="STEPS=5 bash scripts/gpu-session.sh", carry=[".gpukit"])   # what the first call had no time for,
#                                                                            # on the warm machine (nothing rebuilt)
#
# 1. builds the patched libllama with -DGGML_CUDA=ON for sm_90 (ninja, every core) from .gpukit's tree, with kvbench,
#    sparse-attn-check, sparse-attn-perf and kvp-backend-check; or unpacks them where the kit holds them prebuilt
#    (gpu-kit.sh --prebuilt: built here, so the device's minutes go to the checks);
# 2. sparse-attn-check: GGML_OP_SPARSE_ATTN_EXT on CUDA against the CPU backend (issue 12, tests (c)), plus the CPU
#    checks against flash attention and the host reference;
# 3. kvp-backend-check: every preset (and sparse prefill, summarise, the host tier) on the CPU against every layer on
#    CUDA, same tokens: next-token KL and top-1, the layers' kept positions (the engine across backends);
# 4. sparse-attn-perf: the op against flash attention on CUDA, per density, at 8k and 32k cells;
# 5. kvbench with every layer offloaded (-ngl 99) on .gpukit's model: dense against sparse prefill at 32k and 64k
#    tokens (issue 12's 3x target), the retention policies at 8k/10% (observation and eviction on the GPU), and the
#    fates of leaving tokens that move K/V between the GPU and the host (summarise, host tier).
# A prebuilt kit (~40 MB of CUDA libraries) and the model together are more than one call carries: then a first call
# carries .gpukit/cuda-bin.tar.xz and .gpukit/text.txt and runs STEPS="2 4", and a second one right after it, on the
# warm machine (which keeps the first call's ignored files), carries the model and runs STEPS="3 5".
# Everything it prints also goes to $OUT/gpu-session.log (with each step's JSON or markdown beside it: 7 files at
# most, the device returns 8), so a run stopped at its limit still returns what it did. Steps after the build each
# have a time limit; STEPS="2 3" runs only those steps (the build always runs); STEPS=configure stops after CMake's
# configure (a check of the kit on any machine with nvcc, no GPU needed).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
LOG="$OUT/gpu-session.log"
STEPS=${STEPS:-"2 3 4 5"}
T0=$(date +%s)
say() { echo "[gpu-session +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

KIT="$ROOT/.gpukit"
MODEL=$(ls "$KIT"/*.gguf 2>/dev/null | head -1)
TEXT="$KIT/text.txt"  # real prose for the comparisons (the essays corpus), where the kit has it
TEXT_ARGS=(); [ -f "$TEXT" ] && TEXT_ARGS=(-f "$TEXT")
if [ ! -f "$KIT/llama.cpp-patched.tar.gz" ] && [ ! -f "$KIT/cuda-bin.tar.xz" ]; then
    say "no .gpukit/ (run 'bash scripts/gpu-kit.sh' here and carry .gpukit)"; exit 1
fi
need_model() { # steps 3 and 5 run the model; 2 and 4 need none (a prebuilt kit too large for one call: see gpu-kit.sh)
    [ -n "$MODEL" ] && return 0
    say "step $1 skipped: no model in .gpukit (carry .gpukit/*.gguf)"; return 1
}
nvidia-smi -L 2>&1 | tee -a "$LOG"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$NVCC" --version 2>&1 | tail -2 | tee -a "$LOG"

SERIES=$(cat $(ls native/patches/*.patch | LC_ALL=C sort) | md5sum | cut -c1-32)
B=/tmp/pykvcache-cuda-build

# 1. the build: prebuilt here (.gpukit/cuda-bin.tar.xz), or built from the kit's tree
if [ -f "$KIT/cuda-bin.tar.xz" ]; then
    rm -rf "$B" && mkdir -p "$B" && tar -C "$B" -xJf "$KIT/cuda-bin.tar.xz"
    if [ "$(head -1 "$B/.pykvcache-patches")" != "$SERIES" ]; then
        say "the kit's binaries were built with another patch series than native/patches: rerun scripts/gpu-kit.sh"; exit 1
    fi
    # the binaries ask for the CUDA runtime and cuBLAS by soname: the toolkit's, $CUBLAS_DIR, or the image's Python wheels
    CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
    for lib in libcudart.so libcublas.so libcublasLt.so; do
        d=$(dirname "$(find "$CUDA_ROOT"/ ${CUBLAS_DIR:-} $(python3 -c "import nvidia; print(nvidia.__path__[0])" 2>/dev/null) \
                   -name "$lib.*" 2>/dev/null | head -1)")
        [ "$d" != . ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
    say "prebuilt binaries in $B (ldd: $(LD_LIBRARY_PATH="$B/bin:${LD_LIBRARY_PATH:-}" ldd "$B/bin/libggml-cuda.so" | grep -c 'not found') libraries not found)"
    [ "$STEPS" = configure ] && exit 0
else
    # the patched tree where llama_source.cmake looks for it: its stamp names this series, so nothing is re-patched
    export PYKVCACHE_CACHE_DIR=/tmp/pykvcache-cache
    SRC=/tmp/llama.cpp-kit
    HASH=$(printf %s "$SRC" | md5sum | cut -c1-8)
    DST="$PYKVCACHE_CACHE_DIR/llama.cpp-patched-$HASH"
    KIT_SUM=$(md5sum < "$KIT/llama.cpp-patched.tar.gz" | cut -c1-32)
    if [ "$(cat "$DST/.kit-md5" 2>/dev/null)" != "$KIT_SUM" ]; then
        # unpacked once per machine: a second call on the warm machine keeps the file times, so ninja rebuilds nothing
        rm -rf "$SRC" "$DST" && mkdir -p "$SRC" "$DST"
        tar -C "$DST" -xzf "$KIT/llama.cpp-patched.tar.gz"
        cp -r "$DST/." "$SRC/"
        echo "$KIT_SUM" > "$DST/.kit-md5"
    fi
    if [ "$(head -1 "$DST/.pykvcache-patches")" != "$SERIES" ]; then
        say "the kit's tree was patched with another series than native/patches: rerun scripts/gpu-kit.sh"; exit 1
    fi

    # cuBLAS: $CUBLAS_DIR (a folder holding include/ and lib/), else the toolkit's own, else the nvidia-cublas wheel of
    # the image's Python
    CMAKE_EXTRA=()
    CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
    if [ -n "${CUBLAS_DIR:-}" ] || ! find "$CUDA_ROOT" -name cublas_v2.h 2>/dev/null | grep -q .; then
        CUB=${CUBLAS_DIR:-$(python3 -c "import nvidia, os; print(nvidia.__path__[0])" 2>/dev/null)}
        INC=$(dirname "$(find "$CUB" -name cublas_v2.h 2>/dev/null | head -1)")
        LIB=$(dirname "$(find "$CUB" -name 'libcublas.so*' 2>/dev/null | head -1)")
        say "cuBLAS from $CUB: $INC, $LIB"
        for f in "$LIB"/lib*.so.*; do [ -e "${f%%.so.*}.so" ] || ln -sf "$(basename "$f")" "${f%%.so.*}.so" 2>/dev/null; done
        CMAKE_EXTRA+=("-DCMAKE_CUDA_FLAGS=-I$INC" "-DCMAKE_CXX_FLAGS=-I$INC"
                      "-DCUDA_cublas_LIBRARY=$LIB/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$LIB/libcublasLt.so"
                      "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath,$LIB" "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath,$LIB")
    fi

    configure() {
        cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
              -DCMAKE_CUDA_COMPILER="$NVCC" -DLLAMA_CPP_SOURCE_DIR="$SRC" "${CMAKE_EXTRA[@]}" "$@" > "$OUT/configure.log" 2>&1
    }
    say "configure (CUDA, sm_90)"
    if ! configure; then
        # CMake finds no driver library (CUDA::cuda_driver) where the toolkit has no stubs: ggml's legacy memory pool
        say "configure failed; again with -DGGML_CUDA_NO_VMM=ON"
        rm -rf "$B"
        configure -DGGML_CUDA_NO_VMM=ON || { tail -40 "$OUT/configure.log" | tee -a "$LOG"; say "configure failed"; exit 1; }
    fi
    [ "$STEPS" = configure ] && { say "configured $B"; exit 0; }
    say "build"
    cmake --build "$B" --target llama kvbench sparse-attn-check sparse-attn-perf kvp-backend-check -j "$(nproc)" > "$OUT/build.log" 2>&1 \
        || { grep -B2 -A12 -m3 'error' "$OUT/build.log" | tee -a "$LOG"; say "build failed"; exit 1; }
    say "built"
fi
export LD_LIBRARY_PATH="$B/bin:${LD_LIBRARY_PATH:-}"
run() { # run LIMIT NAME CMD...: one step, its output appended to $OUT/NAME and the log
    local limit=$1 name=$2; shift 2
    say "$name: $*"
    timeout "$limit" "$@" > "$OUT/$name.part" 2>> "$LOG"
    local rc=$?
    cat "$OUT/$name.part" >> "$OUT/$name" && rm -f "$OUT/$name.part"
    tail -40 "$OUT/$name" >> "$LOG"
    say "$name: exit $rc"
}

# 2. cross-backend checks of the op (CUDA = CPU on randomised shapes, KV types and counts)
if step 2; then
    run 90 sparse-attn-check.json "$B/sparse-attn-check" --cases 200 --threads 16
fi
# 3. the engine across backends: every policy on the CPU against every layer on CUDA, same tokens
if step 3 && need_model 3; then
    run 100 kvp-backend-check.json "$B/kvp-backend-check" -m "$MODEL" "${TEXT_ARGS[@]}" -p 4096 -n 32 -t 16
fi
# 4. the op against flash attention on CUDA
if step 4; then
    run 30 sparse-attn-perf.md "$B/sparse-attn-perf" --n-kv 8192  --block 32 -t 16
    run 40 sparse-attn-perf.md "$B/sparse-attn-perf" --n-kv 32768 --block 32 -t 16
fi
# 5. kvbench with every layer on the GPU
if step 5 && need_model 5; then
    run 120 kvbench-sparse.json "$B/kvbench" -m "$MODEL" -ngl 99 -t 16 -p 32768,65536 -n 8 -r 2 -o json --no-limit \
        "${TEXT_ARGS[@]}" --policy full --policy none+sparse
    run 80 kvbench-policies.json "$B/kvbench" -m "$MODEL" -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json "${TEXT_ARGS[@]}" \
        --policy full --policy sink_recent:n_sink=4,n_recent=815 --policy snapkv:budget=0.1 --policy h2o:budget=0.1 \
        --policy pyramid:budget=0.1 --policy entropy:budget=0.1
    run 60 kvbench-fates.json "$B/kvbench" -m "$MODEL" -ngl 99 -t 16 -p 8192 -n 64 -r 2 -o json --no-limit "${TEXT_ARGS[@]}" \
        --policy full --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise --policy freeze
fi
say "done"
