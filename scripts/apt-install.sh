#!/usr/bin/env bash
# Installs those of the Debian packages named that are missing (nothing when all are there:
# idempotent), with sudo when not root. For the cross builds' scripts.
#   scripts/apt-install.sh PKG...
set -euo pipefail
missing=()
for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
((${#missing[@]})) || exit 0
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
echo "[apt] installing: ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
