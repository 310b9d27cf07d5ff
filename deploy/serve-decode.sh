#!/usr/bin/env bash
# Serves the decode node on all interfaces with the memory plan of this device now: the
# part every phone-side script shares (Termux, Debian under proot, plain aarch64 Linux).
#   deploy/serve-decode.sh [--dry-run] BIN MODEL.gguf [N_CTX]
# BIN is the edgesplit-decode binary. PARALLEL (default 2) answers are written at once,
# each with its own N_CTX tokens of KV. RPC_LISTEN (e.g. 0.0.0.0:50053) also serves the
# layer split's ggml RPC behind the shared secret. JOIN=CODE joins the router showing the
# code (the device's key comes with it); a device that joined serves as such from then on,
# taking the model file when it lacks it, its context size and KV settings from the
# router, and planning its memory itself (N_CTX and the plan below are then not used).
# RPC_LISTEN needs the shared secret file: a joined device holds a key of its own.
# --dry-run prints the commands instead.
set -euo pipefail
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
BIN="${1:?usage: deploy/serve-decode.sh [--dry-run] BIN MODEL.gguf [N_CTX]}"
MODEL="${2:?usage: deploy/serve-decode.sh [--dry-run] BIN MODEL.gguf [N_CTX]}"
N_CTX="${3:-4096}"
PARALLEL="${PARALLEL:-2}"

# A joined device (JOIN=CODE now, or an earlier join kept in ~/.config/edgesplit/joined)
# has its key from the router and is reached where it announces itself from.
JOINED_DIR="${EDGESPLIT_JOIN_DIR:-$HOME/.config/edgesplit/joined}"
reach=()
JOINED=0
if [[ -n "${JOIN:-}" ]]; then
    reach=(--join "$JOIN")
    JOINED=1
elif [[ -s "$JOINED_DIR/router.json" ]]; then
    JOINED=1
else
    # The shared secret (scripts/secret.sh on the laptop made it; copy the same file
    # here): the node listens on every interface, so without it the node refuses to start.
    SECRET_FILE="${EDGESPLIT_SECRET_FILE:-$HOME/.config/edgesplit/secret}"
    if [[ ! -s "$SECRET_FILE" ]]; then
        if ((DRY)); then
            echo "# no shared secret at $SECRET_FILE yet: join with JOIN=CODE, or copy the laptop's there first (deploy/README.md)"
        else
            echo "[decode] no shared secret at $SECRET_FILE and no join: run with JOIN=CODE (the code the router shows), or copy the laptop's deploy/secret there (deploy/README.md)" >&2
            exit 1
        fi
    fi
    export EDGESPLIT_SECRET_FILE="$SECRET_FILE"
    # The address the laptop reaches this device at: PHONE_IP, else the Wi-Fi
    # interface's (Android refuses `ip` to some apps; then give PHONE_IP).
    IP="${PHONE_IP:-$(ip -4 addr show wlan0 2>/dev/null | awk '/inet /{print $2}' | cut -d/ -f1 || true)}"
    reach=(--handoff-advertise "${IP:-127.0.0.1}:50061" --v1-advertise "http://${IP:-127.0.0.1}:50062/v1/handoff")
fi
if ((JOINED)); then
    cmd=("$BIN" --model "$MODEL" --parallel "$PARALLEL"
        --listen 0.0.0.0:50052 --handoff-listen 0.0.0.0:50061 --v1-listen 0.0.0.0:50062
        "${reach[@]}")
    if ((DRY)); then echo "+ ${cmd[*]}"; else exec "${cmd[@]}"; fi
    exit 0
fi
if ((DRY)); then
    BUDGET="<from the plan>"
    echo "+ $BIN --model $MODEL --parallel $PARALLEL --plan"
else
    echo "[decode] memory plan for this device now:" >&2
    "$BIN" --model "$MODEL" --parallel "$PARALLEL" --plan
    BUDGET="$("$BIN" --model "$MODEL" --parallel "$PARALLEL" --plan 2>/dev/null \
        | awk '/--kv-budget-bytes/{for(i=1;i<=NF;i++) if($i=="--kv-budget-bytes") print $(i+1)}')"
fi
cmd=("$BIN" --model "$MODEL" --n-ctx "$N_CTX" --parallel "$PARALLEL"
    --listen 0.0.0.0:50052 --handoff-listen 0.0.0.0:50061 --v1-listen 0.0.0.0:50062
    "${reach[@]}" --kv-budget-bytes "${BUDGET:-0}")
if [[ -n "${RPC_LISTEN:-}" ]]; then
    cmd+=(--rpc-listen "$RPC_LISTEN")
fi
if ((DRY)); then
    echo "+ ${cmd[*]}"
else
    exec "${cmd[@]}"
fi
