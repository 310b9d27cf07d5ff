#!/data/data/com.termux/files/usr/bin/bash
# Phone side (Android, Termux): builds the decode node natively and runs it.
#   bash deploy/termux.sh MODEL.gguf [N_CTX]
# PARALLEL (default 2) answers are written at once, each with its own N_CTX tokens of KV.
# Cannot be run on this development machine (needs Termux on aarch64); the test suite
# only lints it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${1:?usage: deploy/termux.sh MODEL.gguf [N_CTX]}"
N_CTX="${2:-4096}"
PARALLEL="${PARALLEL:-2}"

# Toolchain and build tools from Termux's own repository (no rustup needed).
pkg install -y rust clang cmake make python binutils
# Keep the CPU awake while serving: Android suspends background processes otherwise.
command -v termux-wake-lock >/dev/null && termux-wake-lock

cd "$ROOT"
# No -C target-cpu=native (see ARCHITECTURE.md): ggml's defaults target ARMv8 NEON, which
# every phone has. Two threads per big core cluster is a good start; see --threads.
cargo build --release -p edgesplit-decode

IP="$(ip -4 addr show wlan0 2>/dev/null | awk '/inet /{print $2}' | cut -d/ -f1)"
echo "[termux] memory plan for this phone now:" >&2
./target/release/edgesplit-decode --model "$MODEL" --parallel "$PARALLEL" --plan
BUDGET="$(./target/release/edgesplit-decode --model "$MODEL" --parallel "$PARALLEL" --plan 2>/dev/null \
    | awk '/--kv-budget-bytes/{for(i=1;i<=NF;i++) if($i=="--kv-budget-bytes") print $(i+1)}')"
exec ./target/release/edgesplit-decode --model "$MODEL" --n-ctx "$N_CTX" --parallel "$PARALLEL" \
    --listen 0.0.0.0:50052 --handoff-listen 0.0.0.0:50061 --v1-listen 0.0.0.0:50062 \
    --handoff-advertise "${IP:-127.0.0.1}:50061" --v1-advertise "http://${IP:-127.0.0.1}:50062/v1/handoff" \
    --kv-budget-bytes "${BUDGET:-0}"
