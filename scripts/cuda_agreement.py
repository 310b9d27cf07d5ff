#!/usr/bin/env python3
"""How far a CUDA prefill node's answers agree with all-CPU ones, and what the GPU's prefill
is worth. Run by scripts/cuda-agreement.sh, which starts the services; standard library only
(the GPU machine has no registry).

Routers (URLs given by the launcher):
  cpu   the CUDA build with no visible device (so it computes on the CPU) + the CPU decode node
  gpu   the CUDA build on the GPU + the same decode node
  gpus  as gpu, with --stream-prefill (the live handoff sends the state while it is prefilled)

For each prompt (several texts cut to 32..2,000 tokens) and answer (greedy, and one fixed
seed at temperature 0.8), the modes below are compared token by token with `cpu local` (one
device, all CPU): the common prefix and whether the whole answer is the same.
  cpu local, cpu phone    all CPU (two processes: the baseline's own repeatability)
  gpu local               all GPU (prefill and decode)
  gpu after               GPU prefill, the state crosses, CPU decode (the product's split)
  gpu live                GPU prefill and first tokens, CPU decode after the switch
First (so that a deadline cuts the comparison, not them) the longest prompt's prefill,
TTFT and live switch, each router, medians of repeats.

Writes OUT/agreement.json (every answer's ids and timing) and prints a summary.
"""

import json
import os
import statistics
import sys
import time
import urllib.request

MAX_TOKENS = int(os.environ.get("AGREE_MAX_TOKENS", "128"))
LENGTHS = [int(x) for x in os.environ.get("AGREE_LENGTHS", "32,128,512,1024,2000").split(",")]
SOURCES = os.environ.get("AGREE_SOURCES", "README.md,ARCHITECTURE.md,proto/PROTOCOL.md").split(",")
REPEATS = int(os.environ.get("AGREE_REPEATS", "3"))
DEADLINE = time.time() + float(os.environ.get("AGREE_SECONDS", "400"))
MODES = [
    ("cpu", "local", None),
    ("cpu", "phone", None),
    ("gpu", "local", None),
    ("gpu", "v2", "after"),
    ("gpu", "v2", "live"),
]


def post(url, body, timeout=300):
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def ask(url, prompt, transport, handoff, seed):
    es = {"transport": transport, "return_token_ids": True}
    if handoff:
        es["handoff"] = handoff
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 1, "edgesplit": es}
    if seed is None:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=seed)
    t0 = time.monotonic()
    v = post(url, body)
    wall_ms = (time.monotonic() - t0) * 1000
    e = v["edgesplit"]
    if e.get("fallback"):
        raise SystemExit(f"{transport}/{handoff}: fell back: {e['fallback']}")
    if transport == "v2" and not e.get("handoff_bytes"):
        raise SystemExit(f"{transport}/{handoff}: no state crossed: {e}")
    return {
        "ids": e["token_ids"],
        "logprobs": v["choices"][0]["logprobs"]["token_logprobs"],
        "prompt_tokens": v["usage"]["prompt_tokens"],
        "timing": {k: e.get(k) for k in (
            "ttft_ms", "prefill_ms", "handoff_ms", "handoff_bytes", "switch_ms",
            "decode_node_tokens", "prefill_tokens", "handoff_mode")},
        "e2e_ms": wall_ms,
    }


def prompts(root):
    out = []
    for src in SOURCES:
        text = open(os.path.join(root, src), encoding="utf-8").read()
        # Prose, not the opening title: from the first blank line on.
        text = text[text.find("\n\n") + 2:]
        for n in LENGTHS:
            # ~3 characters a token for these Markdown files with SmolLM2's tokenizer.
            out.append((src, n, text[: 3 * n]))
    return out


def common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main():
    urls = json.loads(sys.argv[1])
    root, out_dir = sys.argv[2], sys.argv[3]
    rows = []
    result = {"max_tokens": MAX_TOKENS, "rows": rows, "speed": {}}

    def save():
        with open(os.path.join(out_dir, "agreement.json"), "w") as f:
            json.dump(result, f, indent=1)

    # Warm-up: the first request of each router pays one-time costs (CUDA's kernels).
    for name in urls:
        ask(urls[name], "Hello there. " * 40, "local", None, None)

    # Prefill speed: the longest prompt, each router local, and the live handoff's switch.
    src, n, prompt = [p for p in prompts(root) if p[1] == max(LENGTHS)][0]
    for router in urls:
        for transport, handoff in (("local", None), ("v2", "live")):
            runs = []
            for _ in range(REPEATS):
                if time.time() > DEADLINE:
                    break
                runs.append(ask(urls[router], prompt, transport, handoff, None))
            if not runs:
                continue
            med = lambda k: statistics.median(r["timing"][k] or 0 for r in runs)  # noqa: E731
            result["speed"][f"{router} {transport}"] = {
                "prompt_tokens": runs[0]["prompt_tokens"],
                "runs": len(runs),
                "prefill_ms": med("prefill_ms"),
                "ttft_ms": med("ttft_ms"),
                "switch_ms": med("switch_ms"),
                "decode_node_tokens": med("decode_node_tokens"),
                "e2e_ms": statistics.median(r["e2e_ms"] for r in runs),
            }
            save()
    for seed in (None, 7):
        for src, n, prompt in prompts(root):
            if time.time() > DEADLINE:
                result["stopped"] = "deadline"
                save()
                summary(result)
                return
            row = {"source": src, "target_tokens": n, "seed": seed, "answers": {}}
            for router, transport, handoff in MODES:
                name = f"{router} {transport}" + (f" {handoff}" if handoff else "")
                row["answers"][name] = ask(urls[router], prompt, transport, handoff, seed)
            base = row["answers"]["cpu local"]["ids"]
            row["prompt_tokens"] = row["answers"]["cpu local"]["prompt_tokens"]
            row["common"] = {k: common(base, a["ids"]) for k, a in row["answers"].items()}
            row["length"] = {k: len(a["ids"]) for k, a in row["answers"].items()}
            # The chosen tokens' log-probabilities where both answers have the same context.
            lp = row["answers"]["cpu local"]["logprobs"]
            row["logprob_diff"] = {
                k: [abs(x - y) for x, y in zip(lp[: row["common"][k]], a["logprobs"])]
                for k, a in row["answers"].items()
            }
            rows.append(row)
            print(f"[agree] {src} {row['prompt_tokens']} tokens seed={seed}: "
                  + ", ".join(f"{k} {row['common'][k]}/{row['length'][k]}" for k in row["common"]),
                  flush=True)
            save()

    summary(result)


def summary(result):
    for k, v in result["speed"].items():
        tps = v["prompt_tokens"] / v["prefill_ms"] * 1000 if v["prefill_ms"] else 0
        after = v["switch_ms"] - v["ttft_ms"] if v["switch_ms"] else None
        print(f"  speed {k:10s} {v['prompt_tokens']} prompt tokens, {v['runs']} runs: prefill "
              f"{v['prefill_ms']:.0f} ms ({tps:.0f} tokens/s), TTFT {v['ttft_ms']:.0f} ms, e2e "
              f"{v['e2e_ms']:.0f} ms"
              + (f", switch {after:.0f} ms after the first token, decode node wrote "
                 f"{v['decode_node_tokens']:.0f}" if after is not None else ""))
    rows = result["rows"]
    if not rows:
        print("[agree] no answers")
        return
    print(f"\n[agree] {len(rows)} prompts x {len(rows[0]['answers'])} modes, "
          f"{result['max_tokens']} tokens each; common prefix with `cpu local`:")
    for k in rows[0]["answers"]:
        same = sum(1 for r in rows if r["common"][k] == r["length"]["cpu local"] == r["length"][k])
        firsts = [r["common"][k] for r in rows if r["common"][k] < r["length"]["cpu local"]]
        diffs = [d for r in rows for d in r["logprob_diff"][k]]
        print(f"  {k:14s} identical {same}/{len(rows)}"
              + (f"; |logprob diff| of the same tokens mean {statistics.mean(diffs):.5f} "
                 f"max {max(diffs):.5f} over {len(diffs)}" if diffs else "")
              + (f"; where they differ, first differing token at {sorted(firsts)}" if firsts else ""))


if __name__ == "__main__":
    main()
