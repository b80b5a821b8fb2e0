#!/usr/bin/env bash
# CUDA compile check of pykvcache on any machine with nvcc (no GPU needed).
#
#   bash scripts/check-cuda.sh            # (a) compile-check the project's CUDA sources and the ggml CUDA kernels its
#                                         #     graphs run on, against the patched tree, for sm_90 and sm_86
#   bash scripts/check-cuda.sh --full     # (b) the whole -DGGML_CUDA=ON build of the patched libllama and the tools, timed
#
# Options: --arch "90;86" (CMAKE_CUDA_ARCHITECTURES), --full, -j N (parallel jobs, default: the CPU count).
# Without nvcc it prints one line and exits 0 (CI runs it when nvcc is present). cuBLAS headers and libraries come
# from the CUDA toolkit if it has them, else from the PyPI wheel `nvidia-cublas` (CUDA 13) or `nvidia-cublas-cu12`,
# downloaded once into the pykvcache cache ($PYKVCACHE_CACHE_DIR, else $XDG_CACHE_HOME/pykvcache or ~/.cache/pykvcache). The build folder lives in
# that cache too, so a second run only recompiles what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

ARCH="90;86"
FULL=0
JOBS=$(nproc 2>/dev/null || echo 2)
while [ $# -gt 0 ]; do
    case "$1" in
        --full) FULL=1 ;;
        --arch|-j)
            [ $# -ge 2 ] || { echo "check-cuda: $1 needs a value (see --help)" >&2; exit 2; }
            if [ "$1" = --arch ]; then ARCH="$2"; else JOBS="$2"; fi
            shift ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "check-cuda: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

NVCC=$(command -v nvcc || true)
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    if [ -z "$NVCC" ] && [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then NVCC="$d/bin/nvcc"; fi
done
if [ -z "$NVCC" ]; then
    echo "check-cuda: nvcc not found (PATH, \$CUDA_HOME, /usr/local/cuda): CUDA compile check skipped"
    exit 0
fi
# the toolkit's root, as nvcc itself reports it (nvcc may be a wrapper script elsewhere on PATH)
CUDA_ROOT=$("$NVCC" -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
CUDA_ROOT=$(readlink -f "${CUDA_ROOT:-$(dirname "$(readlink -f "$NVCC")")/..}")
NVCC="$CUDA_ROOT/bin/nvcc"
CUDA_MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
echo "check-cuda: $NVCC (CUDA $CUDA_MAJOR), architectures $ARCH"

CACHE=${PYKVCACHE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pykvcache}
PY=${PYTHON:-python3}

# cuBLAS: the toolkit's own, or the PyPI wheel's include/ and lib/
CMAKE_EXTRA=()
if [ ! -f "$CUDA_ROOT/include/cublas_v2.h" ] && [ ! -f "$CUDA_ROOT/targets/x86_64-linux/include/cublas_v2.h" ]; then
    if [ "$CUDA_MAJOR" -ge 13 ]; then wheel=nvidia-cublas; sub=cu13; else wheel="nvidia-cublas-cu$CUDA_MAJOR"; sub=cublas; fi
    WDIR="$CACHE/cuda-wheels/$wheel"
    if [ ! -f "$WDIR/include/cublas_v2.h" ]; then
        echo "check-cuda: fetching cuBLAS headers and libraries ($wheel wheel) into $WDIR"
        rm -rf "$WDIR.tmp" && mkdir -p "$WDIR.tmp"
        "$PY" -m pip download --disable-pip-version-check --no-deps -q "$wheel" -d "$WDIR.tmp"
        (cd "$WDIR.tmp" && "$PY" -m zipfile -e ./*.whl x >/dev/null)
        src=$(dirname "$(find "$WDIR.tmp/x" -name cublas_v2.h | head -1)")/..
        rm -rf "$WDIR" && mkdir -p "$WDIR" && cp -r "$src/include" "$src/lib" "$WDIR/" && rm -rf "$WDIR.tmp"
        for f in "$WDIR"/lib/lib*.so.*; do ln -sf "$(basename "$f")" "${f%%.so.*}.so"; done
    fi
    CMAKE_EXTRA+=("-DCMAKE_CUDA_FLAGS=-I$WDIR/include" "-DCMAKE_CXX_FLAGS=-I$WDIR/include"
                  "-DCUDA_cublas_LIBRARY=$WDIR/lib/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$WDIR/lib/libcublasLt.so"
                  "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$WDIR/lib" "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath-link,$WDIR/lib")
fi

# without the driver library (no GPU here, no stubs in the toolkit) ggml cannot link its VMM pool: build without it
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' && [ -z "$(find "$CUDA_ROOT" -name 'libcuda.so' 2>/dev/null | head -1)" ]; then
    echo "check-cuda: no libcuda.so (driver) here: configuring with -DGGML_CUDA_NO_VMM=ON"
    CMAKE_EXTRA+=("-DGGML_CUDA_NO_VMM=ON")
fi

# the patched tree, configured for CUDA (the same CMakeLists as the Python build)
BUILD="$CACHE/cuda-build-$(printf %s "$ROOT" | md5sum | cut -c1-8)"  # one per checkout
if ! command -v ninja >/dev/null 2>&1; then
    echo "check-cuda: needs ninja (pip install ninja)"; exit 1
fi
if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "^CMAKE_CUDA_ARCHITECTURES:STRING=$ARCH\$" "$BUILD/CMakeCache.txt"; then
    rm -rf "$BUILD"  # another architecture list: configure afresh
fi
t0=$(date +%s)
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_COMPILER="$NVCC" "-DCMAKE_CUDA_ARCHITECTURES=$ARCH" "${CMAKE_EXTRA[@]}" >"$BUILD.configure.log" 2>&1 \
    || { tail -30 "$BUILD.configure.log"; echo "check-cuda: CMake configure with -DGGML_CUDA=ON failed (log: $BUILD.configure.log)"; exit 1; }
echo "check-cuda: configured $BUILD in $(( $(date +%s) - t0 )) s"

if [ "$FULL" = 1 ]; then
    t0=$(date +%s)
    cmake --build "$BUILD" --target llama kvbench sparse-attn-check sparse-attn-perf kvp-backend-check -j "$JOBS"
    echo "check-cuda: full CUDA build of libllama + kvbench and the check tools for sm_$ARCH in $(( $(date +%s) - t0 )) s ($JOBS jobs)"
    echo "check-cuda: for a GPU session: bash scripts/gpu-kit.sh --prebuilt $BUILD"
    exit 0
fi

# (a) the project's own CUDA sources, and the ggml CUDA kernels of the ops our graphs add (observation: soft_max
# with sinks, out_prod, set_rows, cpy; sparse prefill: pool_2d, argsort, and the dispatch of our op in ggml-cuda.cu;
# per-layer attention: flash attention goes through the upstream kernels)
mapfile -t OWN < <(find native -name '*.cu' | sort)
KERNELS=(softmax out-prod set-rows cpy ggml-cuda pool2d argsort)
TARGETS=()
for f in "${OWN[@]}"; do TARGETS+=("$(basename "$f")"); done
for k in "${KERNELS[@]}"; do TARGETS+=("$k.cu"); done
[ ${#OWN[@]} -eq 0 ] && echo "check-cuda: the project has no CUDA sources of its own yet; checking the ggml kernels its graphs run on"

# object files of those sources, as ninja names them
OBJS=()
for t in "${TARGETS[@]}"; do
    o=$(ninja -C "$BUILD" -t targets all | sed -n "s/^\([^:]*\/$t\.o\): .*/\1/p" | head -1)
    [ -z "$o" ] && { echo "check-cuda: no object for $t in the CUDA build"; exit 1; }
    OBJS+=("$o")
done
t0=$(date +%s)
ninja -C "$BUILD" -j "$JOBS" "${OBJS[@]}"
echo "check-cuda: compiled ${#TARGETS[@]} CUDA sources (${TARGETS[*]}) for sm_$ARCH in $(( $(date +%s) - t0 )) s: ok"
