#!/usr/bin/env bash
# Runs a stock llama.cpp llama-bench (built once by scripts/stock-llama.sh) on MODEL:
#   bench/stock-llama-bench.sh MODEL [THREADS] [REPS]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="$1"; THREADS="${2:-$(nproc)}"; REPS="${3:-5}"
BIN="$(bash "$ROOT/scripts/stock-llama.sh")"
"$BIN/llama-bench" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r "$REPS" -o md
