#!/usr/bin/env bash
# Phone side (Android, Termux), through Debian under proot-distro: the decode node is built
# and run as on any aarch64 Linux (deploy/linux-decode.sh), where neither of the two
# blockers of a native Termux build exists. The fallback when deploy/termux.sh
# fails on a phone. Costs (from published reports, see deploy/README.md): proot traps every
# system call through ptrace, so compute runs at native speed but syscall-heavy work
# (building, many small socket writes) is slower.
#   bash deploy/termux-proot.sh [--dry-run] MODEL.gguf [N_CTX]
# MODEL must be inside this repository or under $HOME (both are bound into Debian).
# --dry-run prints every command instead of running it (the test suite checks it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
MODEL="${1:?usage: deploy/termux-proot.sh [--dry-run] MODEL.gguf [N_CTX]}"
N_CTX="${2:-4096}"
run() {
    if ((DRY)); then echo "+ $*"; else "$@"; fi
}

run pkg install -y proot-distro
if ((DRY)) || ! proot-distro login debian -- true 2>/dev/null; then
    run proot-distro install debian
fi
if command -v termux-wake-lock >/dev/null || ((DRY)); then run termux-wake-lock; fi
DRY_FLAG=()
((DRY)) && DRY_FLAG=(--dry-run)
# The repository and $HOME are bound at the same paths inside Debian; the host's network
# is Debian's (proot shares it), so the ports serve the LAN as in Termux.
run proot-distro login debian --bind "$ROOT:$ROOT" --bind "$HOME:$HOME" -- \
    env PARALLEL="${PARALLEL:-2}" bash "$ROOT/deploy/linux-decode.sh" "${DRY_FLAG[@]}" "$MODEL" "$N_CTX"
