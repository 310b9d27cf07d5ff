#!/usr/bin/env bash
# Phone side (Android, Termux), native: builds the decode node with Termux's own Rust,
# clang and protoc, and serves it.
#   bash deploy/termux.sh [--dry-run] MODEL.gguf [N_CTX]
# Two things stop a plain `cargo build` in Termux, where Rust's host and target are both
# aarch64-linux-android (issue 20): the vendored protoc has no Android binary (so PROTOC
# points at Termux's `protobuf` package; proto/build.rs honours it), and llama-cpp-sys-2's
# build script wants an Android NDK for any Android target (so a copy of the crate, patched
# by patches/llama-cpp-sys-2-android-native.patch to build natively when host and target
# are the same, replaces it for this build only, through cargo's --config patch).
# --dry-run prints every command instead of running it (the test suite checks it). If the
# native build fails on your phone, deploy/termux-proot.sh builds inside Debian instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
MODEL="${1:?usage: deploy/termux.sh [--dry-run] MODEL.gguf [N_CTX]}"
N_CTX="${2:-4096}"
run() {
    if ((DRY)); then echo "+ $*"; else "$@"; fi
}

# Toolchain and build tools from Termux's own repository (no rustup needed).
run pkg install -y rust clang cmake make python binutils protobuf patch
# Keep the CPU awake while serving: Android suspends background processes otherwise.
if command -v termux-wake-lock >/dev/null || ((DRY)); then run termux-wake-lock; fi

cd "$ROOT"
# The workspace's llama-cpp-sys-2 (vendor/, the pinned crate with patches/README.md's
# patches), copied and patched once more for a native Android build; vendor/ stays as it is.
VERSION="$(sed -n 's/^llama-cpp-sys-2 = { version = "=\([0-9.]*\)".*/\1/p' Cargo.toml)"
PATCHED="$ROOT/target/phone/llama-cpp-sys-2-$VERSION"
if [[ ! -f "$PATCHED/.edgesplit-patched" ]]; then
    run rm -rf "$PATCHED"
    run mkdir -p "$ROOT/target/phone"
    run cp -r "$ROOT/vendor/llama-cpp-sys-2" "$PATCHED"
    run patch -p1 -d "$PATCHED" -i "$ROOT/patches/llama-cpp-sys-2-android-native.patch"
    run touch "$PATCHED/.edgesplit-patched"
fi
# No -C target-cpu=native (see ARCHITECTURE.md): ggml's defaults target ARMv8 NEON, which
# every phone has.
run env PROTOC="${PREFIX:-/data/data/com.termux/files/usr}/bin/protoc" \
    cargo build --release -p edgesplit-decode \
    --config "patch.crates-io.llama-cpp-sys-2.path=\"$PATCHED\""

DRY_FLAG=()
((DRY)) && DRY_FLAG=(--dry-run)
exec bash "$ROOT/deploy/serve-decode.sh" "${DRY_FLAG[@]}" "$ROOT/target/release/edgesplit-decode" "$MODEL" "$N_CTX"
