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
# shellcheck source=scripts/loopback-stack.sh
source "$ROOT/scripts/loopback-stack.sh"
start_decode "$OUT/decode.log" "$BIN/edgesplit-decode" --model "$MODEL" --n-ctx 4096 \
    --threads "$TD" --flash-attn "$FA"
start_prefill "$OUT/prefill.log" "$BIN/edgesplit-prefill" --model "$MODEL" --n-ctx 4096 \
    --threads "$TP" --flash-attn "$FA"
start_router "$OUT/router.log" "$BIN/edgesplit-router" --token-idle-timeout-ms 600000 \
    --first-token-timeout-s 600
AGREE_MAX_TOKENS=48 python3 - "$ROUTER" "$ROOT" <<'PY'
import sys
url, root = sys.argv[1], sys.argv[2]
sys.path.insert(0, f"{root}/scripts")
from cuda_agreement import ask, common  # noqa: E402 (the same requests and comparison)
for src, n in [("README.md", 1850), ("proto/PROTOCOL.md", 525), ("proto/PROTOCOL.md", 1068),
               ("proto/PROTOCOL.md", 1958)]:
    t = open(f"{root}/{src}", encoding="utf-8").read()
    t = t[t.find("\n\n") + 2:][: 3 * n]
    local = ask(url, t, "local", None, None)
    phone = ask(url, t, "phone", None, None)["ids"]
    after = ask(url, t, "v2", "after", None)["ids"]
    ids = local["ids"]
    print(f"{src} {local['prompt_tokens']} tokens: phone {common(ids, phone)}/{len(ids)}, "
          f"after {common(ids, after)}/{len(ids)}", flush=True)
PY
