#!/usr/bin/env bash
# Builds a stock llama.cpp (llama-server, llama-bench) from the sources vendored in the
# llama-cpp-python==0.3.36 sdist on PyPI - what a user would run instead of EdgeSplit - once,
# into .build/stock-llama.cpp (ignored by git), and prints the folder of its binaries.
# About 5 minutes on 2 cores the first time; nothing afterwards.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/.build/stock-llama.cpp"
BIN="$SRC/build/bin"
mkdir -p "$ROOT/.build"
# One build at a time: tests running in parallel (the bench's, the router's) all call this
# script, and a second run must wait for the first instead of removing its sources.
exec 9>"$ROOT/.build/stock-llama.lock"
flock 9
if [[ ! -x "$BIN/llama-server" || ! -x "$BIN/llama-bench" ]]; then
    mkdir -p "$ROOT/.build"
    if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
        tmp="$(mktemp -d)"
        # Three tries: a registry that times out once should not fail the suite.
        for try in 1 2 3; do
            if PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip download --quiet --no-deps \
                --no-binary=:all: -d "$tmp" "llama-cpp-python==0.3.36" >&2; then
                break
            fi
            [[ $try -lt 3 ]] || exit 1
            echo "[stock-llama] download failed (try $try of 3); retrying" >&2
            sleep 5
        done
        tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
        rm -rf "$SRC"
        mv "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp "$SRC"
        rm -rf "$tmp"
    fi
    # GGML_NATIVE=OFF: the same ggml defaults (AVX2/FMA/F16C on x86-64) as our build;
    # native crashes on this machine's AMX CPU (see ARCHITECTURE.md).
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
    cmake --build "$SRC/build" --target llama-server llama-bench -j "$(nproc)" >&2
fi
echo "$BIN"
