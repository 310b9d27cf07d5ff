#!/usr/bin/env bash
# Is every answer the one-device answer whatever each node's thread count? For each model
# (SmolLM2, Gemma-3), KV cache type (f16, q8_0) and pair of thread counts (prefill/decode:
# 2/2, then 1, 2, 3, 4 and 8 on either node), starts the CPU build's decode node, prefill
# node and router on loopback (`--n-ctx 4096`), asks prompts of ~100 to ~1,900 tokens
# (across the 512 cells where llama.cpp's split-KV flash attention starts) greedy and
# seeded as `local`, `phone`, `v2` after and `v2` live, and compares each answer's token ids
# and log-probabilities with the first pair's `local` answer. Prints a Markdown table; exits
# non-zero when any answer differs. ~1 hour on 2 cores for the whole grid.
#
#   scripts/threads-agreement.sh                                   the whole grid
#   scripts/threads-agreement.sh --models smollm2 --kv f16 --pairs 2/2,2/1,1/2
#
# Needs the CPU build (cargo build --release) and both models (scripts/setup.sh --gemma).
# Figures: docs/BENCHMARKS.md, "Thread count". Not part of scripts/test.sh: the suite's
# identity tests run their two nodes at different thread counts instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec python3 "$ROOT/scripts/threads_agreement.py" "$@"
