#!/usr/bin/env bash
# The speed of patches/ggml-cpu-fa-no-split-kv.patch (docs/BENCHMARKS.md, "Thread count"):
# this checkout's edgesplit-bench against the same commit with only that patch's kernel
# change reversed (built in a worktree of its own under .build/fa-unpatched), alternated
# round by round on the same cores, each round `edgesplit-bench engine` (prefill of 512
# tokens, 64 tokens decoded at depth 1,800). Prints each round's figures and the ratios
# patched/unpatched of the means and of the medians.
#
#   scripts/fa-patch-speed.sh [--threads T] [--rounds R]
#
# Run it with nothing else on the machine: the rounds scatter by ~10% even so.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
THREADS=1
ROUNDS=8
while (($#)); do
    case "$1" in
    --threads) THREADS="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    *) echo "usage: $0 [--threads T] [--rounds R]" >&2; exit 2 ;;
    esac
done
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f "$MODEL" ]] || bash scripts/setup.sh >&2
cargo build --release --workspace --all-targets >&2
WT="$ROOT/.build/fa-unpatched"
if [[ ! -d "$WT" ]]; then
    git worktree add -f --detach "$WT" HEAD >&2
fi
# The worktree at this commit; its vendored crate kept as it is (reversed, built) when
# this commit's is the same, so that a second run builds nothing.
if [[ "$(git -C "$WT" rev-parse HEAD:vendor)" != "$(git rev-parse HEAD:vendor)" ]]; then
    git -C "$WT" checkout -q -f --detach "$(git rev-parse HEAD)"
else
    git -C "$WT" checkout -q --detach "$(git rev-parse HEAD)"
fi
OPS=vendor/llama-cpp-sys-2/llama.cpp/ggml/src/ggml-cpu/ops.cpp
if git -C "$WT" diff --quiet -- "$OPS"; then
    # The kernel hunk only: the build-id hunk of ggml-cpu.cpp does not apply in reverse on
    # top of the other patches, and it changes no computation.
    patch -s -R -p1 -d "$WT/vendor/llama-cpp-sys-2" <"$ROOT/patches/ggml-cpu-fa-no-split-kv.patch" || true
    rm -f "$WT/$(dirname "$OPS")"/*.rej "$WT/$(dirname "$OPS")"/*.orig
fi
if git -C "$WT" diff --quiet -- "$OPS"; then
    echo "the patch's kernel change was not reversed in $WT" >&2
    exit 1
fi
(cd "$WT" && cargo build --release -p edgesplit-bench --bin edgesplit-bench >&2)
CPUS=0
((THREADS > 1)) && CPUS="0-$((THREADS - 1))"
python3 - "$ROUNDS" "$THREADS" "$CPUS" "$MODEL" "$ROOT/target/release/edgesplit-bench" \
    "$WT/target/release/edgesplit-bench" <<'EOF'
import re, statistics, subprocess, sys
rounds, threads, cpus, model = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
bins = {"patched": sys.argv[5], "unpatched": sys.argv[6]}
res = {v: {"pp": [], "tg": []} for v in bins}
for r in range(rounds):
    for v in (["patched", "unpatched"] if r % 2 == 0 else ["unpatched", "patched"]):
        out = subprocess.run(["taskset", "-c", cpus, bins[v], "engine", "--model", model,
                              "--threads", threads, "--pp", "512", "--tg", "64",
                              "--depth", "1800", "--reps", "2"],
                             capture_output=True, text=True, check=True).stdout
        pp = float(re.search(r"\| pp512[^|]*\| ([0-9.]+)", out).group(1))
        tg = float(re.search(r"\| tg64[^|]*\| ([0-9.]+)", out).group(1))
        res[v]["pp"].append(pp)
        res[v]["tg"].append(tg)
        print(f"round {r} {v}: pp512 {pp} t/s, tg64 @ d1800 {tg} t/s", flush=True)
for k, name in (("pp", "prefill"), ("tg", "decode at depth 1800")):
    p, u = res["patched"][k], res["unpatched"][k]
    print(f"{name}, {threads} thread(s): patched/unpatched {statistics.mean(p) / statistics.mean(u):.3f} "
          f"(means), {statistics.median(p) / statistics.median(u):.3f} (medians)")
EOF
