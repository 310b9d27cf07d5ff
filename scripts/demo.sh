#!/usr/bin/env bash
# The main job: sets up, builds, starts the decode node, the prefill node and the router on
# loopback with the default model, answers one chat request through the disaggregated path
# (prefill -> V2 KV handoff -> decode), prints it with its timing, and keeps serving until
# Ctrl-C.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
MODEL="${EDGESPLIT_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
ROUTER_PORT="${ROUTER_PORT:-8080}"
PREFILL_PORT="${PREFILL_PORT:-50051}"
DECODE_PORT="${DECODE_PORT:-50052}"
HANDOFF_PORT="${HANDOFF_PORT:-50061}"
V1_PORT="${V1_PORT:-50062}"
METRICS_PORT="${METRICS_PORT:-50063}"
PROMPT="${PROMPT:-Explain in two sentences why the sky is blue.}"

echo "[demo] building (first time: ~5 minutes on 2 cores)" >&2
cargo build --release --bins --quiet

for p in "$ROUTER_PORT" "$PREFILL_PORT" "$DECODE_PORT" "$HANDOFF_PORT" "$V1_PORT" "$METRICS_PORT"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
        echo "[demo] port $p is in use; set ROUTER_PORT/PREFILL_PORT/DECODE_PORT/HANDOFF_PORT/V1_PORT/METRICS_PORT" >&2
        exit 1
    fi
done

LOGS="$ROOT/.build/logs"
mkdir -p "$LOGS"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM

BIN="$ROOT/target/release"
"$BIN/edgesplit-decode" --model "$MODEL" --listen "127.0.0.1:$DECODE_PORT" \
    --handoff-listen "127.0.0.1:$HANDOFF_PORT" --v1-listen "127.0.0.1:$V1_PORT" >"$LOGS/decode.log" 2>&1 &
pids+=($!)
"$BIN/edgesplit-prefill" --model "$MODEL" --listen "127.0.0.1:$PREFILL_PORT" \
    --metrics-listen "127.0.0.1:$METRICS_PORT" >"$LOGS/prefill.log" 2>&1 &
pids+=($!)
"$BIN/edgesplit-router" --listen "127.0.0.1:$ROUTER_PORT" \
    --prefill-url "http://127.0.0.1:$PREFILL_PORT" --decode-url "http://127.0.0.1:$DECODE_PORT" \
    --bench-db "$ROOT/bench/results/bench.sqlite" \
    >"$LOGS/router.log" 2>&1 &
pids+=($!)

URL="http://127.0.0.1:$ROUTER_PORT"
for _ in $(seq 1 120); do
    curl -sf "$URL/health" >/dev/null 2>&1 && break
    for p in "${pids[@]}"; do
        kill -0 "$p" 2>/dev/null || { echo "[demo] a service exited; see $LOGS" >&2; tail -n 20 "$LOGS"/*.log >&2; exit 1; }
    done
    sleep 1
done
curl -sf "$URL/health" >/dev/null || { echo "[demo] services not healthy after 120 s; see $LOGS" >&2; exit 1; }

echo "[demo] all three services healthy; asking: $PROMPT" >&2
BODY=$(python3 -c 'import json,sys; print(json.dumps({"messages":[{"role":"user","content":sys.argv[1]}],"max_tokens":96,"temperature":0}))' "$PROMPT")
curl -sf "$URL/v1/chat/completions" -H 'content-type: application/json' -d "$BODY" | python3 -c '
import json, sys
r = json.load(sys.stdin)
t = r["edgesplit"]
print("\nanswer:", r["choices"][0]["message"]["content"])
print("\nusage: %(prompt_tokens)d prompt + %(completion_tokens)d completion tokens" % r["usage"])
print("mode:  %s, chosen by the router (%s)" % (t.get("mode"), t.get("reason")))
if t.get("handoff_bytes"):
    print("path:  prefill node -> %s handoff (%s bytes in %.1f ms) -> decode node wrote %s tokens" % (t["transport"], t["handoff_bytes"], t["handoff_ms"] or 0, t["decode_node_tokens"]))
else:
    print("path:  %s, no state crossed" % t["transport"])
print("time:  TTFT %.1f ms, prefill %.1f ms, decode %.1f tokens/s" % (t["ttft_ms"] or 0, t["prefill_ms"] or 0, t["decode_tokens_per_s"] or 0))
'
cat >&2 <<MSG

[demo] serving an OpenAI-compatible API on $URL (logs in $LOGS). Try:
  curl -N $URL/v1/chat/completions -d '{"messages":[{"role":"user","content":"Hi"}],"stream":true}'
or open the dashboard: $URL/dashboard
Ctrl-C stops all three services.
MSG
wait
