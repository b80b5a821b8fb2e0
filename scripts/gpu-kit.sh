#!/usr/bin/env bash
# Prepares what a GPU session carries to the device machine, which reaches no registry and takes at most 64 MiB:
#
#   bash scripts/gpu-kit.sh [--layers N] [--prebuilt DIR]
#
# writes .gpukit/ (ignored by git, named in the device run's `carry`):
#   - llama.cpp-patched.tar.gz: the patched llama.cpp tree of this checkout (our patch series applied, from the cache
#     that scripts/setup.sh fills), trimmed to what the CUDA build of libllama needs (ggml without the backends we
#     never build, src/, include/, cmake/), with the patch stamp, so the device needs neither the sdist nor `patch`;
#     or, with --prebuilt DIR (a CUDA build folder of this checkout, e.g. `bash scripts/check-cuda.sh --full --arch 90`
#     then the targets sparse-attn-check and sparse-attn-perf), cuda-bin.tar.xz: its libraries and tools, stripped,
#     so that the device spends no time building (a fix is then rebuilt here, incrementally, between two calls);
#   - smollm2-<N>l.gguf: the embedded SmolLM2-135M Q4_1 cut to its first N layers (default 8, ~47 MB; the real
#     weights, so attention and entropy look like a real model's; the output is not a language model's) for the CUDA
#     checks and the long-context speed runs;
#   - text.txt: the essays corpus (pykvcache.corpus, 0.6 MB), the prompts' text there.
# Then `scripts/gpu-session.sh` runs on the device (see its header). Rerun this script whenever native/patches changes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}

LAYERS=8
PREBUILT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --layers)   LAYERS="$2"; shift ;;
        --prebuilt) PREBUILT="$2"; shift ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-kit: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

CACHE=${PYKVCACHE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pykvcache}
PATCHED="$CACHE/llama.cpp-0.3.36-patched"
SERIES=$(cat $(ls native/patches/*.patch | LC_ALL=C sort) | md5sum | cut -c1-32)
if [ ! -f "$PATCHED/.pykvcache-patches" ] || [ "$(head -1 "$PATCHED/.pykvcache-patches")" != "$SERIES" ]; then
    echo "gpu-kit: $PATCHED does not hold this checkout's patch series: run 'bash scripts/setup.sh' first" >&2
    exit 1
fi

KIT="$ROOT/.gpukit"
rm -rf "$KIT" && mkdir -p "$KIT"
grep -qx '/.gpukit/' .gitignore 2>/dev/null || { echo "gpu-kit: .gitignore must list /.gpukit/" >&2; exit 1; }

# the patched tree, without the backends this project never builds (ggml/src/CMakeLists adds a backend's folder only
# when its GGML_<NAME> option is on)
DROP=()
for d in "$PATCHED"/ggml/src/ggml-*/; do
    name=$(basename "$d")
    case "$name" in ggml-cpu|ggml-cuda|ggml-rpc|ggml-blas) ;; *) DROP+=("--exclude=ggml/src/$name") ;; esac
done
if [ -n "$PREBUILT" ]; then
    TOOLS=(kvbench sparse-attn-check sparse-attn-perf kvp-backend-check)
    grep -q "^GGML_CUDA:BOOL=ON" "$PREBUILT/CMakeCache.txt" 2>/dev/null || { echo "gpu-kit: $PREBUILT is not a CUDA build folder" >&2; exit 1; }
    # brought up to date with this checkout (seconds when it is; ccache-backed when not)
    cmake --build "$PREBUILT" --target llama "${TOOLS[@]}" > "$KIT/prebuilt-build.log" 2>&1 \
        || { tail -20 "$KIT/prebuilt-build.log" >&2; echo "gpu-kit: building $PREBUILT failed" >&2; exit 1; }
    rm -f "$KIT/prebuilt-build.log"
    STAGE=$(mktemp -d)
    mkdir -p "$STAGE/bin"
    cp "${TOOLS[@]/#/$PREBUILT/}" "$STAGE/"
    cp -P "$PREBUILT"/bin/lib*.so* "$STAGE/bin/"
    # libllama keeps its symbol table (5 MB): a backtrace on the device then names the engine's functions
    strip --strip-unneeded "$STAGE"/* $(ls "$STAGE"/bin/*.so | grep -v libllama.so) 2>/dev/null || true
    echo "$SERIES" > "$STAGE/.pykvcache-patches"
    tar -C "$STAGE" -cJf "$KIT/cuda-bin.tar.xz" .
    rm -rf "$STAGE"
    echo "gpu-kit: $(du -h "$KIT/cuda-bin.tar.xz" | cut -f1) cuda-bin.tar.xz (prebuilt in $PREBUILT, patch series $SERIES)"
else
    tar -C "$PATCHED" -czf "$KIT/llama.cpp-patched.tar.gz" "${DROP[@]}" \
        CMakeLists.txt LICENSE .pykvcache-patches cmake ggml include src licenses vendor
    echo "gpu-kit: $(du -h "$KIT/llama.cpp-patched.tar.gz" | cut -f1) llama.cpp-patched.tar.gz (patch series $SERIES)"
fi

# the model, cut to its first LAYERS layers
(cd / && "$PY" -c "import gguf") 2>/dev/null || { echo "gpu-kit: needs the gguf package (bash scripts/setup.sh --test)" >&2; exit 1; }
MODEL=$(cd / && "$PY" -c "from pykvcache.llama import default_model_path; print(default_model_path())")
(cd / && "$PY" -c "import sys; from pathlib import Path; from pykvcache._models.gguf_copy import write_first_layers
write_first_layers(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))" "$MODEL" "$KIT/smollm2-${LAYERS}l.gguf" "$LAYERS")
echo "gpu-kit: $(du -h "$KIT/smollm2-${LAYERS}l.gguf" | cut -f1) smollm2-${LAYERS}l.gguf"
# real prose for the comparisons and benchmarks there (the essays corpus, from its registry package)
(cd / && "$PY" -c "from pykvcache.corpus import essays_file; print(essays_file())" | xargs -I{} cp {} "$KIT/text.txt")

# what travels: the tracked and untracked-not-ignored files, plus the kit
TREE=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
KITB=$(du -sb "$KIT" | cut -f1)
TOTAL=$(( (TREE + KITB) / 1048576 ))
echo "gpu-kit: working tree + kit = $TOTAL MiB (the device takes 64 MiB a call)"
if [ "$TOTAL" -ge 63 ] && [ -n "$PREBUILT" ]; then
    # the prebuilt libraries and the model in two calls on one warm machine (it keeps the first call's ignored files)
    echo "gpu-kit: ready, in two calls on the device, the second right after the first:"
    echo "  STEPS=\"2 4\" bash scripts/gpu-session.sh   carry: .gpukit/cuda-bin.tar.xz .gpukit/text.txt"
    echo "  STEPS=\"3 5\" bash scripts/gpu-session.sh   carry: .gpukit/$(basename "$KIT"/*.gguf) .gpukit/text.txt"
    exit 0
fi
[ "$TOTAL" -lt 63 ] || { echo "gpu-kit: too large; use --layers with fewer layers" >&2; exit 1; }
echo "gpu-kit: ready; on the device: bash scripts/gpu-session.sh (carry: .gpukit)"
