#!/usr/bin/env bash
# Checks that vendor/llama-cpp-sys-2 is exactly the registry's llama-cpp-sys-2 at the pinned
# version, less the ggml GPU backends no EdgeSplit build compiles, plus the patches listed in
# patches/README.md, in order. Run by scripts/test.sh; fails when the pin moves, a patch no
# longer applies, or the folder was edited by hand.
#
#   scripts/check-vendor.sh            check
#   scripts/check-vendor.sh --write    rebuild the folder from the registry's crate
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENDOR="$ROOT/vendor/llama-cpp-sys-2"
# ggml backends that are never compiled here (the CPU, CUDA and RPC ones are kept).
PRUNED=(cann et hexagon metal opencl openvino sycl virtgpu vulkan webgpu)
# Applied in this order (patches/README.md says why each exists).
PATCHES=(llama-cpp-sys-2-aarch64-arch.patch ggml-cpu-fa-no-split-kv.patch llama-cpp-det-math.patch
    llama-cpp-common-slim.patch)
fail() { echo "[vendor] FAILED: $*" >&2; exit 1; }

VERSION="$(sed -n 's/^llama-cpp-sys-2 = { version = "=\([0-9.]*\)".*/\1/p' "$ROOT/Cargo.toml")"
[[ -n "$VERSION" ]] || fail "no exact llama-cpp-sys-2 pin in Cargo.toml"

# The workspace replaces the crate with the vendored one, so cargo fetches the registry's
# copy only for a manifest of its own.
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/fetch/src"
touch "$TMP/fetch/src/lib.rs"
cat >"$TMP/fetch/Cargo.toml" <<EOF
[package]
name = "fetch-llama-cpp-sys-2"
version = "0.0.0"
edition = "2021"

[dependencies]
llama-cpp-sys-2 = { version = "=$VERSION", default-features = false }
EOF
cargo fetch -q --manifest-path "$TMP/fetch/Cargo.toml"
SRC="$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -maxdepth 2 -mindepth 2 -type d \
    -name "llama-cpp-sys-2-$VERSION" -print -quit)"
[[ -f "$SRC/build.rs" ]] || fail "llama-cpp-sys-2 $VERSION not in cargo's registry"

EXPECTED="$TMP/llama-cpp-sys-2"
cp -r "$SRC" "$EXPECTED"
rm -f "$EXPECTED/.cargo-ok"
for b in "${PRUNED[@]}"; do
    rm -rf "$EXPECTED/llama.cpp/ggml/src/ggml-$b"
done
for p in "${PATCHES[@]}"; do
    patch -s -p1 --no-backup-if-mismatch -d "$EXPECTED" -i "$ROOT/patches/$p" ||
        fail "patches/$p does not apply to llama-cpp-sys-2 $VERSION"
done

if [[ "${1:-}" == "--write" ]]; then
    rm -rf "$VENDOR"
    mkdir -p "$(dirname "$VENDOR")"
    cp -r "$EXPECTED" "$VENDOR"
    echo "[vendor] wrote vendor/llama-cpp-sys-2 ($VERSION + ${PATCHES[*]})" >&2
    exit 0
fi
grep -q "^version = \"$VERSION\"" "$VENDOR/Cargo.toml" ||
    fail "vendor/llama-cpp-sys-2 is not version $VERSION (the pin in Cargo.toml)"
diff -r -q "$EXPECTED" "$VENDOR" >&2 ||
    fail "vendor/llama-cpp-sys-2 differs from the registry's $VERSION plus patches/ (scripts/check-vendor.sh --write rebuilds it)"
echo "[vendor] vendor/llama-cpp-sys-2 is llama-cpp-sys-2 $VERSION plus ${PATCHES[*]}" >&2
