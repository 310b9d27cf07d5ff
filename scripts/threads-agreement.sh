#!/usr/bin/env bash
# Does a split answer depend on the engines' thread counts? Starts the CPU build's decode
# node (DECODE threads), prefill node (PREFILL threads) and a router on loopback, asks four
# long prompts (this repository's Markdown, 544-1,919 tokens) for 48 greedy tokens as
# `local`, `phone` and `v2` `after`, and prints how many tokens of each agree with `local`.
#
#   scripts/threads-agreement.sh PREFILL DECODE [FLASH_ATTN]     e.g. 2 8 off
#
# Needs the CPU build and SmolLM2 (scripts/setup.sh). Figures: docs/BENCHMARKS.md, "Thread
# count and flash attention". Not part of scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/target/release"
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
TP="${1:?usage: $0 PREFILL-THREADS DECODE-THREADS [auto|on|off]}"
TD="${2:?usage: $0 PREFILL-THREADS DECODE-THREADS [auto|on|off]}"
FA="${3:-auto}"
OUT="$(mktemp -d)"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$OUT"' EXIT
fp() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
D=$(fp); H=$(fp); V=$(fp); P=$(fp); M=$(fp); R=$(fp)
"$BIN/edgesplit-decode" --model "$MODEL" --n-ctx 4096 --threads "$TD" --flash-attn "$FA" \
    --listen "127.0.0.1:$D" --handoff-listen "127.0.0.1:$H" --v1-listen "127.0.0.1:$V" 2>"$OUT/decode.log" &
PIDS+=($!)
"$BIN/edgesplit-prefill" --model "$MODEL" --n-ctx 4096 --threads "$TP" --flash-attn "$FA" \
    --listen "127.0.0.1:$P" --metrics-listen "127.0.0.1:$M" 2>"$OUT/prefill.log" &
PIDS+=($!)
"$BIN/edgesplit-router" --listen "127.0.0.1:$R" --prefill-url "http://127.0.0.1:$P" \
    --decode-url "http://127.0.0.1:$D" --token-idle-timeout-ms 600000 --first-token-timeout-s 600 \
    2>"$OUT/router.log" &
PIDS+=($!)
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$R/health" >/dev/null && break; sleep 0.2; done
python3 - "$R" "$ROOT" <<'PY'
import json, sys, urllib.request
port, root = sys.argv[1], sys.argv[2]
def ask(prompt, transport, handoff=None):
    es = {"transport": transport, "return_token_ids": True}
    if handoff:
        es["handoff"] = handoff
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "edgesplit": es}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(), {"content-type": "application/json"})
    v = json.load(urllib.request.urlopen(req, timeout=900))
    return v["edgesplit"]["token_ids"], v["usage"]["prompt_tokens"]
def common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
for src, n in [("README.md", 1850), ("proto/PROTOCOL.md", 525), ("proto/PROTOCOL.md", 1068),
               ("proto/PROTOCOL.md", 1958)]:
    t = open(f"{root}/{src}", encoding="utf-8").read()
    t = t[t.find("\n\n") + 2:][: 3 * n]
    local, tokens = ask(t, "local")
    phone, _ = ask(t, "phone")
    after, _ = ask(t, "v2", "after")
    print(f"{src} {tokens} tokens: phone {common(local, phone)}/{len(local)}, "
          f"after {common(local, after)}/{len(local)}", flush=True)
PY
