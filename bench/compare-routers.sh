#!/usr/bin/env bash
# Time to first token of two router builds on the same two nodes, in the same run: each
# request goes to one router, then the same request to the other, 40 times per transport
# (streamed chat, 2 tokens, greedy; SmolLM2; loopback, no link emulation). Prints the
# median TTFT of each and the ratio new/old. For a change on the request's path in the
# router alone (for example, no Info call per request).
#   bench/compare-routers.sh OLD_ROUTER_BINARY [NEW_ROUTER_BINARY]
# NEW defaults to target/release/edgesplit-router; both nodes from target/release.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OLD="${1:?usage: bench/compare-routers.sh OLD_ROUTER_BINARY [NEW_ROUTER_BINARY]}"
NEW="${2:-$ROOT/target/release/edgesplit-router}"
B="$ROOT/target/release"
M="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
LOGS="$(mktemp -d)"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
"$B/edgesplit-decode" --model "$M" --n-ctx 2048 --threads 1 --listen 127.0.0.1:51552 \
    --handoff-listen 127.0.0.1:51553 >"$LOGS/decode.log" 2>&1 &
pids+=($!)
"$B/edgesplit-prefill" --model "$M" --n-ctx 2048 --threads 1 --listen 127.0.0.1:51551 \
    >"$LOGS/prefill.log" 2>&1 &
pids+=($!)
nodes=(--prefill-url http://127.0.0.1:51551 --decode-url http://127.0.0.1:51552)
"$OLD" --listen 127.0.0.1:51580 "${nodes[@]}" >"$LOGS/old.log" 2>&1 &
pids+=($!)
"$NEW" --listen 127.0.0.1:51581 "${nodes[@]}" >"$LOGS/new.log" 2>&1 &
pids+=($!)
for port in 51580 51581; do
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
        sleep 1
    done
done
python3 - <<'PY'
import http.client, json, statistics, time

def ttft(port, transport):
    c = http.client.HTTPConnection("127.0.0.1", port)
    body = json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2,
                       "temperature": 0, "stream": True, "edgesplit": {"transport": transport}})
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    while True:
        line = r.readline()
        if not line:
            raise RuntimeError("the stream ended without content")
        if line.startswith(b"data: ") and b'"content"' in line and b'"content":""' not in line:
            t = time.perf_counter() - t0
            r.read()
            c.close()
            return t

for transport in ["local", "v2"]:
    for port in (51580, 51581):
        ttft(port, transport)  # warm-up
    old, new = [], []
    for _ in range(40):
        old.append(ttft(51580, transport))
        new.append(ttft(51581, transport))
    mo, mn = statistics.median(old) * 1000, statistics.median(new) * 1000
    print(f"{transport}: median TTFT old {mo:.2f} ms, new {mn:.2f} ms, new/old {mn / mo:.3f}")
PY
