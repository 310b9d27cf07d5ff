#!/usr/bin/env bash
# Laptop side (Linux or WSL2): builds and runs the prefill node and the router.
# Builds the prefill node with CUDA (scripts/build-cuda.sh) when an NVIDIA GPU is present
# (`nvidia-smi`), for the CPU otherwise.
#   deploy/laptop.sh [CONFIG]      CONFIG defaults to deploy/edgesplit.env (see .example)
# Not run by the test suite (needs a phone on the network); checked with shellcheck.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${1:-$ROOT/deploy/edgesplit.env}"
[[ -f "$CONFIG" ]] || { echo "no $CONFIG: copy deploy/edgesplit.env.example and edit it" >&2; exit 1; }
# Exported: the services read EDGESPLIT_SECRET_FILE / EDGESPLIT_API_KEY(_FILE) themselves.
set -a
# shellcheck source=deploy/edgesplit.env.example
source "$CONFIG"
set +a
: "${MODEL:?set MODEL in $CONFIG}"

# The pair's shared secret, made once (kept when it exists); the phone needs the same file.
export EDGESPLIT_SECRET_FILE="${EDGESPLIT_SECRET_FILE:-$ROOT/deploy/secret}"
bash "$ROOT/scripts/secret.sh" "$EDGESPLIT_SECRET_FILE"
# The API key clients send, made once too: the router listens on the network, where it
# refuses to serve without one (unless EDGESPLIT_API_KEY holds a key already).
if [[ -z "${EDGESPLIT_API_KEY:-}" ]]; then
    export EDGESPLIT_API_KEY_FILE="${EDGESPLIT_API_KEY_FILE:-$ROOT/deploy/api-key}"
    bash "$ROOT/scripts/secret.sh" --api-key "$EDGESPLIT_API_KEY_FILE"
fi

bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
if command -v nvidia-smi >/dev/null; then
    # The CUDA toolkit from PyPI (no system toolkit needed); CUDA_ARCHS picks the GPUs.
    echo "[laptop] NVIDIA GPU found: building the prefill node with CUDA (scripts/build-cuda.sh)" >&2
    PREFILL_BIN="$(bash "$ROOT/scripts/build-cuda.sh" | tail -1)"
else
    echo "[laptop] no NVIDIA GPU: building the prefill node for the CPU" >&2
    cargo build --release -p edgesplit-prefill
    PREFILL_BIN="$ROOT/target/release/edgesplit-prefill"
fi
cargo build --release -p edgesplit-router

BIN="$ROOT/target/release"
# The decode nodes: PHONE_IP's when set; devices that join with a code in any case (the
# router prints a code at start, valid 5 minutes; POST /admin/pairing makes another).
decode=(--decode-url none)
[[ -n "${PHONE_IP:-}" ]] && decode=(--decode-url "http://$PHONE_IP:${DECODE_PORT:-50052}")
# The layer split (RPC_LAYERS: a count or auto): the phone's last layers, planned from both
# devices' available memory; printed first, refused with the numbers if it cannot fit.
split=()
if [[ -n "${RPC_LAYERS:-}" ]]; then
    : "${PHONE_IP:?the layer split needs PHONE_IP in $CONFIG}"
    split=(--rpc-peer "$PHONE_IP:${RPC_PORT:-50053}" --rpc-layers "$RPC_LAYERS"
        --decode-url "http://$PHONE_IP:${DECODE_PORT:-50052}")
    "$PREFILL_BIN" --model "$MODEL" --n-ctx "${N_CTX:-4096}" "${split[@]}" --plan
fi
"$PREFILL_BIN" --model "$MODEL" --n-ctx "${N_CTX:-4096}" "${split[@]}" \
    --listen "${PREFILL_LISTEN:-127.0.0.1:50051}" --metrics-listen "${PREFILL_METRICS:-127.0.0.1:50063}" &
PREFILL=$!
trap 'kill "$PREFILL" 2>/dev/null || true' EXIT
"$BIN/edgesplit-router" --listen "${ROUTER_LISTEN:-0.0.0.0:8080}" \
    --prefill-url "http://${PREFILL_LISTEN:-127.0.0.1:50051}" \
    "${decode[@]}" --join-listen "${JOIN_LISTEN:-0.0.0.0:47475}" --pair \
    --share-model "$MODEL" \
    --transport "${TRANSPORT:-auto}"
