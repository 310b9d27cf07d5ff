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

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() {
    python3 - "$1" <<'EOF'
import sys, time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2)
        sys.exit(0)
    except Exception:
        time.sleep(0.2)
sys.exit(sys.argv[1] + " never answered")
EOF
}

D=$(free_port); H=$(free_port); V=$(free_port)
"$BIN/edgesplit-decode" --model "$MODEL" --n-ctx "$CTX" --listen "127.0.0.1:$D" \
    --handoff-listen "127.0.0.1:$H" --v1-listen "127.0.0.1:$V" 2>"$OUT/decode.log" &
PIDS+=($!)

# serve NAME [ENV...] -- [PREFILL-ARGS...]: a prefill node of the CUDA build and its router;
# appends "NAME": URL to URLS.
URLS=""
serve() {
    local name="$1" P M R
    shift
    local envs=()
    while [[ "$1" != "--" ]]; do envs+=("$1"); shift; done
    shift
    P=$(free_port); M=$(free_port); R=$(free_port)
    env "${envs[@]}" "$CUDA_BIN" --model "$MODEL" --n-ctx "$CTX" --listen "127.0.0.1:$P" \
        --metrics-listen "127.0.0.1:$M" "$@" 2>"$OUT/prefill-$name.log" &
    PIDS+=($!)
    "$BIN/edgesplit-router" --listen "127.0.0.1:$R" --prefill-url "http://127.0.0.1:$P" \
        --decode-url "http://127.0.0.1:$D" 2>"$OUT/router-$name.log" &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$R/health"
    URLS="$URLS${URLS:+, }\"$name\": \"http://127.0.0.1:$R\""
}

serve cpu CUDA_VISIBLE_DEVICES= --
serve gpu EDGESPLIT_UNUSED=1 --
serve gpus EDGESPLIT_UNUSED=1 -- --stream-prefill
for name in cpu gpu gpus; do
    echo "[cuda-agreement] prefill-$name: $(grep -o 'ggml_cuda_init: [^[]*\|no CUDA devices[^[]*\|offloaded [0-9/]* layers to GPU' \
        "$OUT/prefill-$name.log" | sort -u | tr '\n' ';')" >&2
done
python3 "$ROOT/scripts/cuda_agreement.py" "{$URLS}" "$ROOT" "$OUT"
echo "[cuda-agreement] report: $OUT/agreement.json" >&2
