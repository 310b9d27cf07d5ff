#!/usr/bin/env bash
# Builds the phone's decode node on this x86_64 Debian machine: one fully static aarch64
# file (`aarch64-unknown-linux-musl`: no interpreter, no shared library), which runs on
# Android's Linux kernel as it is, in Termux's own userland or anywhere else, and on any
# aarch64 Linux. `edgesplit-decode` and its ggml RPC child `edgesplit-rpc` (the layer
# split), with llama.cpp's ARM kernels for the baseline EDGESPLIT_ARM_ARCH (default
# armv8.2-a+dotprod+fp16: every ARMv8.2 phone core since ~2018, Cortex-A55/A75 on; nothing
# tuned to the build machine), stripped, into target-phone/. Installs what is missing
# (idempotent, like setup.sh). Prints the decode binary's path as the last line of stdout.
#
# `--packages` only installs what the build needs (scripts/test.sh runs it before it
# starts the build in the background, so that no apt run of its own races this one).
#
# Toolchain (no Android NDK is reachable from a package registry, and a static glibc
# program is killed by Android's seccomp policy before `main`; a static musl one is not):
# - Zig (PyPI `ziglang`, pinned, into .build/zig) compiles llama.cpp and every C
#   dependency for aarch64-linux-musl and links the whole file, supplying musl, its start
#   files, libunwind and libc++ (scripts/zig-aarch64-musl is the wrapper every tool calls).
# - Debian's `rustc-web`/`cargo-web` 1.96 and `rust-web-src` (the standard library's
#   sources of the same release) build Rust's std for the target (`-Zbuild-std`, with
#   RUSTC_BOOTSTRAP for that one flag): Debian ships no musl std. std's own dependencies
#   come from crates.io, pinned by its Cargo.lock.
# Decided for the musl file (docs/REFERENCE.md and deploy/README.md say it to users):
# - no OpenMP (zig has no libgomp): ggml's own thread pool runs the threads; the build id
#   treats OpenMP as neutral, so the handshake with an OpenMP prefill node passes;
# - no OpenSSL in llama.cpp (it serves no HTTPS of its own; our links use rustls);
# - no resolver: musl reads /etc/resolv.conf and /etc/hosts, which an Android root lacks;
#   the node serves on addresses it is given and connects to none by name.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET=aarch64-unknown-linux-musl
ARCH="${EDGESPLIT_ARM_ARCH:-armv8.2-a+dotprod+fp16}"
OUT="$ROOT/target-phone"
ZIG_VERSION=0.17.1
ZIG_HOME="$ROOT/.build/zig"
log() { printf '\033[1;34m[phone]\033[0m %s\n' "$*" >&2; }

# --- packages ----------------------------------------------------------------------------
bash "$ROOT/scripts/apt-install.sh" rustc-web cargo-web rust-web-src cmake clang libclang-dev \
    llvm patch python3-pip
if [[ ! -x "$ZIG_HOME/ziglang/zig" ]] || [[ "$("$ZIG_HOME/ziglang/zig" version)" != "$ZIG_VERSION" ]]; then
    log "installing zig $ZIG_VERSION (PyPI ziglang) into .build/zig"
    rm -rf "$ZIG_HOME"
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check \
        --target "$ZIG_HOME" "ziglang==$ZIG_VERSION" >/dev/null
fi
[[ "${1:-}" == "--packages" ]] && exit 0

# --- the toolchain's settings --------------------------------------------------------------
cd "$ROOT"
ZIG_LIB="$("$ZIG_HOME/ziglang/zig" env | sed -n 's/^ *\.lib_dir = "\(.*\)",$/\1/p')"
[[ "$ZIG_LIB" = /* ]] || ZIG_LIB="$PWD/$ZIG_LIB"
WRAP="$ROOT/scripts/zig-aarch64-musl"
export EDGESPLIT_ZIG="$ZIG_HOME/ziglang/zig"
export ZIG_GLOBAL_CACHE_DIR="$ROOT/.build/zig-cache"
export ZIG_LOCAL_CACHE_DIR="$ROOT/.build/zig-cache"
# Every tool the build runs, under the names the wrapper dispatches on.
TOOLS="$OUT/tools"
mkdir -p "$TOOLS"
for t in cc c++ ar ranlib; do
    ln -sf "$WRAP" "$TOOLS/$t"
done
# CMake (llama.cpp): the compilers above, nothing found on this x86 machine's paths.
cat >"$OUT/toolchain.cmake" <<EOF
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER "$TOOLS/cc")
set(CMAKE_CXX_COMPILER "$TOOLS/c++")
set(CMAKE_AR "$TOOLS/ar" CACHE FILEPATH "")
set(CMAKE_RANLIB "$TOOLS/ranlib" CACHE FILEPATH "")
set(CMAKE_FIND_ROOT_PATH "$ZIG_LIB/libc")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(GGML_OPENMP OFF CACHE BOOL "" FORCE)
set(LLAMA_OPENSSL OFF CACHE BOOL "" FORCE)
EOF

bash scripts/copy-sources.sh "$OUT/src"
log "building edgesplit-decode for $TARGET ($ARCH), fully static, into $OUT"
cd "$OUT/src"
# rustc's own link arguments for a static musl file, less its bundled C runtime (zig
# brings musl's, matching the headers llama.cpp was compiled against). No debug info: the
# file is stripped, and compiling it would only lengthen the build.
RUSTC=/usr/bin/rustc \
    RUSTC_BOOTSTRAP=1 \
    CC_aarch64_unknown_linux_musl="$TOOLS/cc" \
    CXX_aarch64_unknown_linux_musl="$TOOLS/c++" \
    AR_aarch64_unknown_linux_musl="$TOOLS/ar" \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER="$TOOLS/cc" \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_RUSTFLAGS="-C link-self-contained=no -C target-feature=+crt-static" \
    CMAKE_TOOLCHAIN_FILE_aarch64_unknown_linux_musl="$OUT/toolchain.cmake" \
    BINDGEN_EXTRA_CLANG_ARGS_aarch64_unknown_linux_musl="-nostdlibinc -isystem $ZIG_LIB/libc/include/aarch64-linux-musl -isystem $ZIG_LIB/libc/include/generic-musl -isystem $ZIG_LIB/libc/include/any-linux-any" \
    GGML_CPU_ARM_ARCH="$ARCH" \
    CARGO_PROFILE_RELEASE_DEBUG=false \
    /usr/bin/cargo build --release --target "$TARGET" --target-dir "$OUT" \
    -Zbuild-std=std,panic_abort -p edgesplit-decode --bins >&2
DIR="$OUT/$TARGET/release"
for b in edgesplit-decode edgesplit-rpc; do
    llvm-strip -o "$OUT/$b" "$DIR/$b"
done
BIN="$OUT/edgesplit-decode"
# Proven static: no program interpreter and no shared library needed.
if readelf -lW "$BIN" | grep -q INTERP || readelf -dW "$BIN" | grep -q NEEDED; then
    readelf -ldW "$BIN" >&2
    log "error: $BIN is not fully static"
    exit 1
fi
file "$BIN" >&2 || true
echo "$BIN"
