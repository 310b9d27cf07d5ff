#!/usr/bin/env bash
# Checks a CUDA-built prefill node (scripts/build-cuda.sh) on this machine: on a machine
# without an NVIDIA GPU or driver it must start, say that it found no CUDA device, and
# serve on the CPU with the CPU build's answers. Starts it beside the CPU build's decode
# node and router on loopback, asks the same greedy question `local` and split (`v2`),
# and compares both with the CPU build's prefill node.
#
#   scripts/check-cuda-build.sh [PATH-TO-CUDA-edgesplit-prefill]
#
# Needs the CPU build (cargo build --release) and the models (scripts/setup.sh). Not run by
# scripts/test.sh (the CUDA build takes too long for CI).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUDA_BIN="${1:-$(find "$ROOT"/target -maxdepth 3 -path '*/cuda-*/release/edgesplit-prefill' 2>/dev/null | head -1)}"
[[ -x "$CUDA_BIN" ]] || { echo "no CUDA-built edgesplit-prefill: run scripts/build-cuda.sh" >&2; exit 1; }
BIN="$ROOT/target/release"
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DIR="$(mktemp -d)"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$DIR"' EXIT

# shellcheck source=scripts/loopback-stack.sh
source "$ROOT/scripts/loopback-stack.sh"
start_decode "$DIR/decode.log" "$BIN/edgesplit-decode" --model "$MODEL" --n-ctx 1024

# Serves `prefill` (a binary) behind a router; sets ROUTER to the router's URL.
serve() {
    start_prefill "$DIR/$2.log" "$1" --model "$MODEL" --n-ctx 1024
    start_router "$DIR/router-$2.log" "$BIN/edgesplit-router"
}

ask() {
    curl -sf "$1/v1/completions" -H 'content-type: application/json' -d \
        "{\"prompt\": \"The river ran past the old mill and\", \"max_tokens\": 24,
          \"temperature\": 0, \"edgesplit\": {\"transport\": \"$2\"}}" |
        python3 -c 'import json,sys
v = json.load(sys.stdin)
e = v.get("edgesplit", {})
if e.get("fallback") or (e.get("transport") == "v2" and not e.get("handoff_bytes")):
    sys.exit("not split: %s" % e)
print(v["choices"][0]["text"])'
}

serve "$CUDA_BIN" cuda
CUDA_R="$ROUTER"
serve "$BIN/edgesplit-prefill" cpu
CPU_R="$ROUTER"
if grep -q "failed to initialize CUDA\|no CUDA devices" "$DIR/cuda.log"; then
    echo "[cuda-check] no CUDA device here; the CUDA build said:" >&2
    grep -o "failed to initialize CUDA[^[]*\|no CUDA devices[^[]*" "$DIR/cuda.log" | head -2 >&2
else
    echo "[cuda-check] the CUDA build did not report a missing device: is there a GPU?" >&2
fi
status=0
for transport in local v2; do
    a=$(ask "$CUDA_R" "$transport"); b=$(ask "$CPU_R" "$transport")
    if [[ "$a" == "$b" ]]; then
        echo "[cuda-check] $transport: the CUDA build's answer is the CPU build's" >&2
    else
        echo "[cuda-check] $transport: answers differ:" >&2
        printf '  cuda: %q\n  cpu:  %q\n' "$a" "$b" >&2
        status=1
    fi
done
exit "$status"
