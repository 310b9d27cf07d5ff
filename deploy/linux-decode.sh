#!/usr/bin/env bash
# A decode node on plain Linux (aarch64: a Raspberry Pi, an ARM laptop, Debian under
# proot on a phone; or x86_64): installs the build tools and Rust if missing, builds the
# decode node and serves it with the device's memory plan.
#   bash deploy/linux-decode.sh [--dry-run] MODEL.gguf [N_CTX]
# --dry-run prints every command instead of running it (the test suite checks it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
MODEL="${1:?usage: deploy/linux-decode.sh [--dry-run] MODEL.gguf [N_CTX]}"
N_CTX="${2:-4096}"
run() {
    if ((DRY)); then echo "+ $*"; else "$@"; fi
}
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"

if ((DRY)) || ! command -v cmake >/dev/null || ! command -v clang >/dev/null; then
    run $SUDO apt-get update -qq
    run $SUDO apt-get install -y -qq build-essential cmake clang libclang-dev curl ca-certificates
fi
if ((DRY)) || ! command -v cargo >/dev/null; then
    # rustup from its official installer (Debian's rustc may be older than the pinned crates need).
    if ((DRY)); then
        echo "+ curl --proto =https --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal"
    else
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
    fi
    export PATH="$HOME/.cargo/bin:$PATH"
fi
cd "$ROOT"
# No -C target-cpu=native (see ARCHITECTURE.md); the vendored protoc runs on aarch64 glibc.
run cargo build --release -p edgesplit-decode
DRY_FLAG=()
((DRY)) && DRY_FLAG=(--dry-run)
exec bash "$ROOT/deploy/serve-decode.sh" "${DRY_FLAG[@]}" "$ROOT/target/release/edgesplit-decode" "$MODEL" "$N_CTX"
