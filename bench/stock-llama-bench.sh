#!/usr/bin/env bash
# Builds a stock llama.cpp llama-bench (and llama-server) from the sources vendored in the
# llama-cpp-python==0.3.36 sdist on PyPI - what a user would run instead of EdgeSplit - and
# runs llama-bench on MODEL with the given threads. The build is cached under .build/.
#   bench/stock-llama-bench.sh MODEL [THREADS] [REPS]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="$1"; THREADS="${2:-$(nproc)}"; REPS="${3:-5}"
SRC="$ROOT/.build/stock-llama.cpp"
BIN="$SRC/build/bin/llama-bench"
if [[ ! -x "$BIN" ]]; then
    mkdir -p "$ROOT/.build"
    tmp="$(mktemp -d)"
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip download --quiet --no-deps --no-binary=:all: \
        -d "$tmp" "llama-cpp-python==0.3.36" >&2
    tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
    rm -rf "$SRC"
    mv "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp "$SRC"
    rm -rf "$tmp"
    # GGML_NATIVE=OFF: the same ggml defaults (AVX2/FMA/F16C on x86-64) as our build;
    # native crashes on this machine's AMX CPU (see ARCHITECTURE.md).
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >&2
    cmake --build "$SRC/build" --target llama-bench llama-server -j "$(nproc)" >&2
fi
"$BIN" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r "$REPS" -o md
