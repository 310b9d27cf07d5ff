#!/usr/bin/env bash
# Copies the workspace's sources into DEST for a cross build (scripts/build-aarch64.sh,
# scripts/build-phone.sh): Debian's cargo-web may rewrite the copy's Cargo.lock, never the
# repository's, which a build for this machine may be reading at the same time
# (scripts/test.sh runs both at once). tar keeps the files' times, so an unchanged file is
# not rebuilt.
#   scripts/copy-sources.sh DEST
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${1:?usage: scripts/copy-sources.sh DEST}"
mkdir -p "$SRC"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
        tar -C "$ROOT" --null -T - -cf - | tar -C "$SRC" -xf -
    # A file gone from the repository goes from the copy too: a module moved into a
    # folder (frame.rs -> frame/mod.rs) would otherwise be found twice.
    comm -13 <(git -C "$ROOT" ls-files --cached --others --exclude-standard | LC_ALL=C sort) \
        <(cd "$SRC" && find . -type f | sed 's#^\./##' | LC_ALL=C sort) |
        (cd "$SRC" && xargs -r -d '\n' rm -f --)
else
    tar -C "$ROOT" --exclude=./target --exclude=./target-aarch64 --exclude=./target-phone \
        --exclude=./.build --exclude=./models -cf - . | tar -C "$SRC" -xf -
fi
