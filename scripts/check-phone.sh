#!/usr/bin/env bash
# What of the phone build (issue 20) can run on this x86_64 machine, run by scripts/test.sh:
#  1. patches/llama-cpp-sys-2-android-native.patch (deploy/termux.sh) applies cleanly to
#     the workspace's llama-cpp-sys-2 (vendor/; scripts/check-vendor.sh checks that folder);
#  2. the proto crate builds with PROTOC pointing at Debian's protobuf-compiler, as it does
#     with Termux's (its own target folder, so the main build is not invalidated);
#  3. each phone-side script's --dry-run prints the commands it would run.
# Nothing here runs on a phone; deploy/README.md says what was and was not run on one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
fail() { echo "[phone] FAILED: $*" >&2; exit 1; }

VERSION="$(sed -n 's/^llama-cpp-sys-2 = { version = "=\([0-9.]*\)".*/\1/p' Cargo.toml)"
[[ -n "$VERSION" ]] || fail "no exact llama-cpp-sys-2 pin in Cargo.toml"
SRC="$ROOT/vendor/llama-cpp-sys-2"
[[ -f "$SRC/build.rs" ]] || fail "no vendor/llama-cpp-sys-2"
patch -p1 --dry-run --force -d "$SRC" -i "$ROOT/patches/llama-cpp-sys-2-android-native.patch" >/dev/null \
    || fail "the Android patch does not apply to the vendored llama-cpp-sys-2 $VERSION"
echo "[phone] the Android patch applies to the vendored llama-cpp-sys-2 $VERSION" >&2

PROTOC_BIN="$(command -v protoc)" || fail "no protoc (apt-get install protobuf-compiler)"
out="$(PROTOC="$PROTOC_BIN" cargo check --release -p edgesplit-proto \
    --target-dir target/protoc-check 2>&1)" || fail "proto with PROTOC=$PROTOC_BIN: $out"
grep -q "protoc from PROTOC: $PROTOC_BIN" <<<"$out" || fail "proto did not use PROTOC: $out"
echo "[phone] proto builds with PROTOC=$PROTOC_BIN" >&2

expect() {  # expect SCRIPT PATTERN...: the script's dry run prints a line matching each
    local script="$1"
    shift
    local out
    out="$(PARALLEL=3 bash "deploy/$script" --dry-run models/phone.gguf 2048)" \
        || fail "$script --dry-run"
    for pattern in "$@"; do
        grep -Eq -- "$pattern" <<<"$out" || fail "$script --dry-run printed no line matching $pattern:
$out"
    done
}
serve='^\+ .*/target/release/edgesplit-decode --model models/phone\.gguf --n-ctx 2048 --parallel 3 --listen 0\.0\.0\.0:50052 .*--kv-budget-bytes'
expect termux.sh '^\+ pkg install -y .*rust.*protobuf' \
    "^\\+ patch -p1 -d .*llama-cpp-sys-2-$VERSION -i .*android-native\\.patch" \
    "^\\+ env PROTOC=.*/protoc cargo build --release -p edgesplit-decode --config patch\\.crates-io\\.llama-cpp-sys-2\\.path=" \
    "$serve"
expect termux-proot.sh '^\+ pkg install -y proot-distro' '^\+ proot-distro install debian' \
    '^\+ proot-distro login debian --bind .* -- env PARALLEL=3 bash .*/deploy/linux-decode\.sh --dry-run models/phone\.gguf 2048'
expect linux-decode.sh '^\+ .*apt-get install .*cmake.*clang' '^\+ cargo build --release -p edgesplit-decode$' "$serve"
echo "[phone] the phone scripts' dry runs print their commands" >&2
