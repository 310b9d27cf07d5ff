#!/usr/bin/env bash
# Phone side (Android, Termux): serves the phone's decode node, the one static aarch64
# file scripts/build-phone.sh builds on the laptop, with this device's memory plan. Nothing
# is built or installed on the phone: the file needs no library, not even Termux's.
#   bash termux.sh [--dry-run] MODEL.gguf [N_CTX]
# The file is EDGESPLIT_DECODE, else `edgesplit-decode` beside this script (copy the file,
# this script and serve-decode.sh into one folder of Termux's home), else
# target-phone/edgesplit-decode in a clone of the repository. --dry-run prints every
# command instead of running it (the test suite checks it).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
MODEL="${1:?usage: termux.sh [--dry-run] MODEL.gguf [N_CTX]}"
N_CTX="${2:-4096}"
run() {
    if ((DRY)); then echo "+ $*"; else "$@"; fi
}

BIN="${EDGESPLIT_DECODE:-}"
if [[ -z "$BIN" ]]; then
    for candidate in "$HERE/edgesplit-decode" "$HERE/../target-phone/edgesplit-decode"; do
        if [[ -f "$candidate" ]]; then
            BIN="$candidate"
            break
        fi
    done
fi
if [[ -z "$BIN" ]]; then
    if ((DRY)); then
        BIN="$HERE/edgesplit-decode"
    else
        echo "[decode] no edgesplit-decode beside this script: build it on the laptop with scripts/build-phone.sh and copy target-phone/edgesplit-decode here (deploy/README.md)" >&2
        exit 1
    fi
fi
# Android's shared storage (/sdcard) does not keep the executable bit: a file copied from
# there is made executable here.
[[ -x "$BIN" ]] || run chmod +x "$BIN"
# Keep the CPU awake while serving: Android suspends background processes otherwise.
if command -v termux-wake-lock >/dev/null || ((DRY)); then run termux-wake-lock; fi

DRY_FLAG=()
((DRY)) && DRY_FLAG=(--dry-run)
exec bash "$HERE/serve-decode.sh" "${DRY_FLAG[@]}" "$BIN" "$MODEL" "$N_CTX"
