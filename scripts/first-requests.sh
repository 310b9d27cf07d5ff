#!/usr/bin/env bash
# A fresh pair's first requests against its tenth: the nodes' warm-up at start measured.
#
# Starts a prefill node, a decode node and a router (on loopback, from target/release),
# sends ten `local` requests of the same size one after the other, and prints each one's
# prefill time and decode speed as the answer's `edgesplit` object reports them; then
# stops the three. Done twice per round: with the nodes' warm-up (the default) and with
# `--no-warmup`; ROUNDS rounds, alternating. With DROP_CACHES=1 (root), the page cache is
# dropped before each start, as after a reboot.
#
#   scripts/first-requests.sh [ROUNDS] [THREADS] [SENTENCES]
#
# The model: models/SmolLM2-135M-Instruct.Q4_1.gguf (scripts/setup.sh). A sentence is
# ~14 tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
THREADS=${2:-2}
SENTENCES=${3:-3}
BIN=target/release
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
LOGS=$(mktemp -d)
PORT0=$((20000 + RANDOM % 20000))
PIDS=()
stop() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
}
trap stop EXIT

one_stack() {
    local label=$1
    shift
    if [[ ${DROP_CACHES:-0} == 1 ]]; then
        sync
        echo 3 >/proc/sys/vm/drop_caches
    fi
    local d=$PORT0 h=$((PORT0 + 1)) v=$((PORT0 + 2)) p=$((PORT0 + 3)) m=$((PORT0 + 4)) r=$((PORT0 + 5))
    "$BIN/edgesplit-decode" --model "$MODEL" --threads "$THREADS" --listen "127.0.0.1:$d" \
        --handoff-listen "127.0.0.1:$h" --v1-listen "127.0.0.1:$v" "$@" >"$LOGS/decode.log" 2>&1 &
    PIDS+=($!)
    "$BIN/edgesplit-prefill" --model "$MODEL" --threads "$THREADS" --listen "127.0.0.1:$p" \
        --metrics-listen "127.0.0.1:$m" "$@" >"$LOGS/prefill.log" 2>&1 &
    PIDS+=($!)
    "$BIN/edgesplit-router" --listen "127.0.0.1:$r" --prefill-url "http://127.0.0.1:$p" \
        --decode-url "http://127.0.0.1:$d" --no-probes >"$LOGS/router.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 300); do
        if curl -sf "127.0.0.1:$r/health" >/dev/null; then break; fi
        sleep 0.1
    done
    for i in $(seq 10); do
        python3 - "$r" "$label" "$i" "$SENTENCES" <<'EOF'
import json, sys, urllib.request
port, label, i, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompt = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * n)
body = {"prompt": f"{prompt} {i}", "max_tokens": 48, "temperature": 0, "cache_prompt": False,
        "edgesplit": {"transport": "local"}}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                             data=json.dumps(body).encode(), headers={"content-type": "application/json"})
e = json.load(urllib.request.urlopen(req))["edgesplit"]
print(f"{label}\t{i}\tprefill_ms {e['prefill_ms']:.0f}\tdecode_tok_s {e['decode_tokens_per_s']:.1f}")
EOF
    done
    stop
}

echo "threads $THREADS, ~$((SENTENCES * 14)) prompt tokens, 48 answer tokens, page cache dropped: ${DROP_CACHES:-0}"
for round in $(seq "$ROUNDS"); do
    echo "round $round"
    one_stack warm-up
    one_stack no-warm-up --no-warmup
done
