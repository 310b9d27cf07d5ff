#!/usr/bin/env bash
# Sets up (packages, both models) and runs the whole test suite: formatting, clippy, and
# every unit and integration test (real services on loopback, real models).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The phone build: the decode node as one static aarch64 file (scripts/build-phone.sh), run
# under qemu-aarch64 in an empty root by router/tests/it/cross_arch.rs, which runs last. Its
# packages first (no other apt run may race them), then the build in the background from
# the start, at the lowest priority: it compiles while the models and the other packages
# download and in what the x86 build and the tests leave idle, and takes nothing from them
# (a test that waits on a model under load times out).
mkdir -p .build
PHONE_LOG="$ROOT/.build/build-phone.log"
echo "[test] the phone build's packages (scripts/build-phone.sh --packages)" >&2
bash scripts/build-phone.sh --packages
echo "[test] the phone's decode node (scripts/build-phone.sh), in the background" >&2
nice -n 19 bash scripts/build-phone.sh >"$PHONE_LOG" 2>&1 &
PHONE_PID=$!
bash scripts/setup.sh --gemma
# The stock llama-server that the bench and the interoperability tests compare against:
# built here, once, so that no test waits on (or races) its build. In the background: its
# compile fills the cores that the package downloads and cargo's serial steps leave idle.
mkdir -p .build
STOCK_LOG="$ROOT/.build/stock-llama.log"
echo "[test] stock llama.cpp (scripts/stock-llama.sh), in the background" >&2
bash scripts/stock-llama.sh >"$STOCK_LOG" 2>&1 &
STOCK_PID=$!
# Test-only packages: shellcheck, Debian's Chromium + ChromeDriver for the dashboard's
# browser test (router/tests/it/dashboard.rs), iproute2 for the join test's network
# namespaces (router/tests/it/join.rs).
missing=()
command -v shellcheck >/dev/null || missing+=(shellcheck)
command -v ip >/dev/null || missing+=(iproute2)
[[ -x /usr/bin/chromium ]] || missing+=(chromium)
[[ -x /usr/bin/chromedriver ]] || missing+=(chromium-driver)
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
if ((${#missing[@]})); then
    echo "[test] installing: ${missing[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# A static qemu-aarch64 for the phone's empty root (router/tests/it/cross_arch.rs): the
# package's files unpacked into .build/qemu-static, not installed (installing it would
# replace qemu-user-binfmt's registrations on this machine).
QEMU_STATIC="$ROOT/.build/qemu-static/usr/bin/qemu-aarch64-static"
if [[ ! -x "$QEMU_STATIC" ]]; then
    echo "[test] qemu-user-static (unpacked into .build/qemu-static)" >&2
    rm -rf .build/qemu-deb && mkdir -p .build/qemu-deb
    (
        cd .build/qemu-deb
        if ! apt-get download -qq qemu-user-static 2>/dev/null; then
            $SUDO apt-get update -qq
            apt-get download -qq qemu-user-static
        fi
    )
    dpkg-deb -x .build/qemu-deb/qemu-user-static_*.deb .build/qemu-static
    rm -rf .build/qemu-deb
fi
echo "[test] shellcheck" >&2
shellcheck -x scripts/*.sh deploy/*.sh bench/*.sh .ci/run
echo "[test] the vendored llama-cpp-sys-2 is the registry's plus patches/ (scripts/check-vendor.sh)" >&2
bash scripts/check-vendor.sh
echo "[test] the phone build (scripts/check-phone.sh)" >&2
bash scripts/check-phone.sh
# The official OpenAI Python client, pinned, for router/tests/it/openai_client.rs (strict
# response validation); into .build/openai-py, not the system's Python.
OPENAI_PY="$ROOT/.build/openai-py"
if [[ ! -d "$OPENAI_PY/openai-1.109.1.dist-info" ]]; then
    echo "[test] the openai Python client (into .build/openai-py)" >&2
    rm -rf "$OPENAI_PY"
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check \
        --target "$OPENAI_PY" "openai==1.109.1" >/dev/null
fi
echo "[test] no import circle, no file over 700 lines (scripts/check-rooms.py)" >&2
python3 scripts/check-rooms.py --self-test
echo "[test] cargo fmt --check" >&2
cargo fmt --all --check
# --release everywhere: one llama.cpp build serves clippy, the tests and the binaries.
echo "[test] cargo clippy" >&2
cargo clippy --release --workspace --all-targets -- -D warnings
echo "[test] cargo test" >&2
# The process-level tests run the real binaries from target/release. Building every target
# in one go gives the binaries the same dependency features as the tests (dev-dependencies
# included), so `cargo test` compiles nothing twice.
cargo build --release --workspace --all-targets
echo "[test] waiting for the stock llama.cpp build" >&2
if ! wait "$STOCK_PID"; then
    echo "[test] the stock llama.cpp build failed; the end of its log ($STOCK_LOG):" >&2
    tail -n 40 "$STOCK_LOG" >&2
    exit 1
fi
# Everything but the test that needs the aarch64 build, which goes on meanwhile.
cargo test --release --workspace -- --skip cross_arch::
echo "[test] waiting for the phone build" >&2
if ! wait "$PHONE_PID"; then
    echo "[test] the phone build failed; the end of its log ($PHONE_LOG):" >&2
    tail -n 40 "$PHONE_LOG" >&2
    exit 1
fi
echo "[test] the static aarch64 decode node under qemu in an empty root (router/tests/it/cross_arch.rs)" >&2
# --workspace: the same features as the build above (a -p build would compile again).
cargo test --release --workspace --test it -- cross_arch::
