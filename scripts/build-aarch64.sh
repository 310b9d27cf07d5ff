#!/usr/bin/env bash
# Cross-builds the decode node for aarch64 Linux (glibc) on this x86_64 Debian machine:
# `edgesplit-decode` and its ggml RPC child `edgesplit-rpc`, with llama.cpp's ARM (NEON)
# kernels for the baseline EDGESPLIT_ARM_ARCH (default armv8.2-a+dotprod+fp16: every
# ARMv8.2 phone core since ~2018, Cortex-A55/A75 on; nothing tuned to the build machine),
# into target-aarch64/. Installs what is missing (idempotent, like setup.sh). Prints the
# decode binary's path as the last line of stdout.
#
# `--measure` also builds what `edgesplit-bench agreement` runs on the aarch64 side: the
# prefill node (`edgesplit-prefill`) and the engine's `score` example. `--packages` only
# installs what the build needs.
#
# The binary runs where glibc does: Debian under proot-distro on a phone, a Raspberry Pi,
# an ARM laptop (deploy/README.md); not Termux's own (bionic) userland. Here it runs under
# `qemu-aarch64` (without `-L`: qemu finds the multiarch loader and libraries this script
# installs; with a cross sysroot it hangs at the first thread).
#
# Toolchain: Debian's `rustc-web`/`cargo-web` (1.96, /usr/bin/rustc, /usr/bin/cargo) with
# its aarch64 standard library; rustup's toolchain stays the default for everything else.
# The same pinned crates (Cargo.lock) and the workspace's vendored llama-cpp-sys-2, whose
# build script takes ggml's ARM baseline from GGML_CPU_ARM_ARCH
# (patches/llama-cpp-sys-2-aarch64-arch.patch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET=aarch64-unknown-linux-gnu
ARCH="${EDGESPLIT_ARM_ARCH:-armv8.2-a+dotprod+fp16}"
OUT="$ROOT/target-aarch64"
log() { printf '\033[1;34m[aarch64]\033[0m %s\n' "$*" >&2; }

SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
# --- packages ----------------------------------------------------------------------------
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    log "adding the arm64 package architecture"
    $SUDO dpkg --add-architecture arm64
    $SUDO apt-get update -qq
fi
bash "$ROOT/scripts/apt-install.sh" rustc-web cargo-web libstd-rust-web-dev:arm64 \
    gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user libgomp1:arm64 libstdc++6:arm64 \
    protobuf-compiler cmake clang libclang-dev patch

# `--packages`: only the above (scripts/test.sh installs them before it starts the build in
# the background, so that no apt run of its own races this one).
[[ "${1:-}" == "--packages" ]] && exit 0

cd "$ROOT"

# --- the build ---------------------------------------------------------------------------
SRC="$OUT/src"
bash scripts/copy-sources.sh "$SRC"

packages=(-p edgesplit-decode --bins)
if [[ "${1:-}" == "--measure" ]]; then
    packages+=(-p edgesplit-prefill -p edgesplit-engine --example score)
fi
log "building ${packages[*]} for $TARGET ($ARCH) into $OUT"
cd "$SRC"
RUSTC=/usr/bin/rustc \
    CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
    CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++ \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    BINDGEN_EXTRA_CLANG_ARGS="--sysroot=/usr/aarch64-linux-gnu" \
    GGML_CPU_ARM_ARCH="$ARCH" \
    /usr/bin/cargo build --release --target "$TARGET" --target-dir "$OUT" "${packages[@]}" >&2
BIN="$OUT/$TARGET/release/edgesplit-decode"
file "$BIN" >&2 || true
echo "$BIN"
