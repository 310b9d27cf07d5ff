#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: how far answers with a CUDA prefill node agree with
# all-CPU ones (the split's CUDA-prefill + CPU-decode answers among them), and the GPU's
# prefill speed against the CPU's. Starts, on loopback, one CPU decode node and three
# prefill nodes of the CUDA build (one with no visible device, so it computes on the CPU;
# one on the GPU; one on the GPU with --stream-prefill), a router for each, and runs
# scripts/cuda_agreement.py against them (it says what is compared).
#
#   scripts/cuda-agreement.sh CUDA-edgesplit-prefill [OUT-DIR]
#
# The decode node and router come from $EDGESPLIT_BIN (default target/release), the model
# from $EDGESPLIT_MODEL (default SmolLM2). Without a GPU it still runs (every "gpu" node then
# computes on the CPU, so every answer must be the baseline's): that is how it is checked
# before a GPU machine's time is spent. Not part of scripts/test.sh (it needs the CUDA
# build). Figures: docs/BENCHMARKS.md, "The CUDA build".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUDA_BIN="${1:?usage: $0 CUDA-edgesplit-prefill [OUT-DIR]}"
OUT="${2:-$(mktemp -d)}"
BIN="${EDGESPLIT_BIN:-$ROOT/target/release}"
MODEL="${EDGESPLIT_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
CTX="${AGREE_CTX:-4096}"
mkdir -p "$OUT"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT

# shellcheck source=scripts/loopback-stack.sh
source "$ROOT/scripts/loopback-stack.sh"
start_decode "$OUT/decode.log" "$BIN/edgesplit-decode" --model "$MODEL" --n-ctx "$CTX"

# serve NAME [ENV...] -- [PREFILL-ARGS...]: a prefill node of the CUDA build and its router;
# appends "NAME": URL to URLS.
URLS=""
serve() {
    local name="$1"
    shift
    local envs=()
    while [[ "$1" != "--" ]]; do envs+=("$1"); shift; done
    shift
    start_prefill "$OUT/prefill-$name.log" env "${envs[@]}" "$CUDA_BIN" --model "$MODEL" \
        --n-ctx "$CTX" "$@"
    start_router "$OUT/router-$name.log" "$BIN/edgesplit-router"
    URLS="$URLS${URLS:+, }\"$name\": \"$ROUTER\""
}

serve cpu CUDA_VISIBLE_DEVICES= --
serve gpu --
serve gpus -- --stream-prefill
# ggml logs only a CUDA failure at this level: none means the node found the GPU.
for name in cpu gpu gpus; do
    said=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/prefill-$name.log" |
        grep -o 'failed to initialize CUDA[^"]*' | sed 's/ *module=.*//' | head -1 || true)
    echo "[cuda-agreement] prefill-$name: ${said:-CUDA initialized}" >&2
done
python3 "$ROOT/scripts/cuda_agreement.py" "{$URLS}" "$ROOT" "$OUT"
echo "[cuda-agreement] report: $OUT/agreement.json" >&2
