#!/usr/bin/env bash
# The phone-side scripts' dry runs, run by scripts/test.sh: each prints the commands it
# would run (the phone's file itself is built by scripts/build-phone.sh and served under
# qemu by router/tests/it/cross_arch.rs). Nothing here runs on a phone; deploy/README.md
# says what was and was not run on one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
fail() { echo "[phone] FAILED: $*" >&2; exit 1; }

expect() {  # expect SCRIPT PATTERN...: the script's dry run prints a line matching each
    local script="$1"
    shift
    local out
    out="$(PARALLEL=3 bash "deploy/$script" --dry-run models/phone.gguf 2048)" \
        || fail "$script --dry-run"
    for pattern in "$@"; do
        grep -Eq -- "$pattern" <<<"$out" || fail "$script --dry-run printed no line matching $pattern:
$out"
    done
}
serve='^\+ .*/target/release/edgesplit-decode --model models/phone\.gguf --n-ctx 2048 --parallel 3 --listen 0\.0\.0\.0:50052 .*--kv-budget-bytes'
expect termux.sh '^\+ termux-wake-lock$' \
    '^\+ .*/edgesplit-decode --model models/phone\.gguf --n-ctx 2048 --parallel 3 --listen 0\.0\.0\.0:50052 .*--kv-budget-bytes'
# Joining with a code: no secret file, no advertised address; the code goes to the node.
JOIN=123-4567-8901 expect termux.sh \
    '^\+ .*/edgesplit-decode --model models/phone\.gguf --parallel [0-9]+ --listen 0\.0\.0\.0:50052 .*--join 123-4567-8901$'
if grep -Eq -- '(cargo|pkg install)' <<<"$(bash deploy/termux.sh --dry-run models/phone.gguf 2048)"; then
    fail "termux.sh --dry-run builds or installs something: it serves the static file only"
fi
expect termux-proot.sh '^\+ pkg install -y proot-distro' '^\+ proot-distro install debian' \
    '^\+ proot-distro login debian --bind .* -- env PARALLEL=3 bash .*/deploy/linux-decode\.sh --dry-run models/phone\.gguf 2048'
expect linux-decode.sh '^\+ .*apt-get install .*cmake.*clang' '^\+ cargo build --release -p edgesplit-decode$' "$serve"
echo "[phone] the phone scripts' dry runs print their commands" >&2
