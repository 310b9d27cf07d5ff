#!/usr/bin/env bash
# Makes the shared secret of an EdgeSplit pair once: 32 random bytes, in hex, in FILE
# (default deploy/secret, which git ignores), readable by its owner only. Idempotent: an
# existing secret is kept, never replaced. Prints where it is and how to put the same file
# on the phone. Every service reads it from EDGESPLIT_SECRET_FILE or --secret-file; with it,
# every link between the devices is TLS keyed by it (ARCHITECTURE.md, threat model).
#   scripts/secret.sh [FILE]
#   scripts/secret.sh --api-key [FILE]   the router's API key instead (default
#                                        deploy/api-key): "sk-" and 32 random bytes in hex,
#                                        which clients send as "Authorization: Bearer <key>"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# make_once WHAT FILE PREFIX: PREFIX and 32 random bytes in hex into FILE, owner-only,
# unless FILE holds something already (kept, never replaced).
make_once() {
    local what="$1" file="$2" prefix="$3"
    if [[ -s "$file" ]]; then
        echo "[secret] keeping the existing $what in $file" >&2
    else
        mkdir -p "$(dirname "$file")"
        umask 077
        # /dev/urandom: the kernel's CSPRNG; od prints it as hex (no openssl needed).
        { printf '%s' "$prefix"; od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; echo; } >"$file.tmp"
        mv "$file.tmp" "$file"
        echo "[secret] made a new $what in $file" >&2
    fi
    chmod 600 "$file"
}

if [[ "${1:-}" == "--api-key" ]]; then
    FILE="${2:-${EDGESPLIT_API_KEY_FILE:-$ROOT/deploy/api-key}}"
    make_once "API key" "$FILE" sk-
    cat >&2 <<MSG
[secret] clients send it as "Authorization: Bearer <key>"; with the OpenAI client:
           OPENAI_BASE_URL=http://LAPTOP_IP:8080/v1 OPENAI_API_KEY="\$(cat $FILE)" ...
         or: curl -H "Authorization: Bearer \$(cat $FILE)" http://LAPTOP_IP:8080/v1/models
MSG
    exit 0
fi
FILE="${1:-${EDGESPLIT_SECRET_FILE:-$ROOT/deploy/secret}}"
make_once secret "$FILE" ""
cat >&2 <<MSG
[secret] put the same file on the phone (the decode node reads ~/.config/edgesplit/secret
         unless EDGESPLIT_SECRET_FILE says otherwise), for example:
           adb push "$FILE" /sdcard/edgesplit-secret
           # then in Termux: mkdir -p ~/.config/edgesplit && mv /sdcard/edgesplit-secret ~/.config/edgesplit/secret && chmod 600 ~/.config/edgesplit/secret
         or over SSH (Termux's sshd listens on 8022):
           scp -P 8022 "$FILE" PHONE_IP:.config/edgesplit/secret
         Both sides log the same 'private links' key fingerprint when they share it.
MSG
