#!/usr/bin/env python3
"""Does an answer depend on the engines' thread counts? The grid behind
scripts/threads-agreement.sh (read that file for the how-to).

For each model, KV cache type and (prefill threads, decode threads) pair, starts the CPU
build's decode node, prefill node and router on loopback, asks each prompt greedy and
seeded as `local` (the prefill node alone), `phone` (the decode node alone), `v2` after
and `v2` live, and compares every answer's token ids and log-probabilities with the
reference: the `local` answer of the first pair. Prints a Markdown table (one row per
model, cache type and pair) and exits non-zero when any answer differs.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}
TRANSPORTS = [("local", None), ("phone", None), ("v2", "after"), ("v2", "live")]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_http(url, procs, seconds=600):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{p.args[0]} exited with {p.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"{url} never answered")


def prompt(tokens_wanted):
    """A deterministic text of about `tokens_wanted` tokens (~22 SmolLM2 tokens a sentence)."""
    harbours = ["Oslo", "Rome", "Lyon", "Graz", "Porto", "Riga"]
    sentences = []
    for i in range(max(1, tokens_wanted // 22)):
        sentences.append(
            f"Day {i}: at {harbours[i % 6]} it was {10 + (i * 7) % 23} degrees, "
            f"wind {(i * 13) % 41} km/h."
        )
    return "Weather log. " + " ".join(sentences) + "\nThe warmest harbour was"


class Stack:
    """The three services, started for one pair of thread counts; stopped on exit."""

    def __init__(self, model, kv, prefill_threads, decode_threads, logdir):
        self.procs = []
        common = ["--model", model, "--n-ctx", "4096", "--cache-type-k", kv,
                  "--cache-type-v", kv]
        d, h, v = free_port(), free_port(), free_port()
        p, m, r = free_port(), free_port(), free_port()
        tag = f"{kv}-{prefill_threads}-{decode_threads}"
        self.start(logdir, f"decode-{tag}", [
            os.path.join(BIN, "edgesplit-decode"), *common, "--threads", str(decode_threads),
            "--listen", f"127.0.0.1:{d}", "--handoff-listen", f"127.0.0.1:{h}",
            "--v1-listen", f"127.0.0.1:{v}"])
        self.start(logdir, f"prefill-{tag}", [
            os.path.join(BIN, "edgesplit-prefill"), *common, "--threads", str(prefill_threads),
            "--listen", f"127.0.0.1:{p}", "--metrics-listen", f"127.0.0.1:{m}"])
        self.start(logdir, f"router-{tag}", [
            os.path.join(BIN, "edgesplit-router"), "--listen", f"127.0.0.1:{r}",
            "--prefill-url", f"http://127.0.0.1:{p}", "--decode-url", f"http://127.0.0.1:{d}",
            "--token-idle-timeout-ms", "600000", "--first-token-timeout-s", "600"])
        self.url = f"http://127.0.0.1:{r}"
        wait_http(self.url + "/health", self.procs)
        # The router answers before it has seen both nodes; wait until both are up.
        end = time.monotonic() + 600
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    health = json.load(resp)
                if health.get("status") == "ok":
                    return
            except Exception:
                pass
            time.sleep(0.3)
        raise SystemExit(f"the stack {tag} never became healthy")

    def start(self, logdir, name, argv):
        log = open(os.path.join(logdir, name + ".log"), "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def ask(url, text, transport, handoff, seed, max_tokens):
    es = {"transport": transport, "return_token_ids": True}
    if handoff:
        es["handoff"] = handoff
    body = {"prompt": text, "max_tokens": max_tokens, "logprobs": 1, "edgesplit": es}
    if seed is None:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        v = json.load(resp)
    e = v["edgesplit"]
    if e.get("fallback"):
        raise SystemExit(f"{transport}/{handoff}: fell back: {e['fallback']}")
    if transport == "v2" and not e.get("handoff_bytes"):
        raise SystemExit(f"{transport}/{handoff}: no state crossed: {e}")
    return {
        "ids": e["token_ids"],
        "logprobs": v["choices"][0]["logprobs"]["token_logprobs"],
        "prompt_tokens": v["usage"]["prompt_tokens"],
    }


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a["ids"], b["ids"])):
        if x != y:
            return i
    if len(a["ids"]) != len(b["ids"]):
        return min(len(a["ids"]), len(b["ids"]))
    if a["logprobs"] != b["logprobs"]:
        return "logprobs"
    return None


def pairs(spec):
    out = []
    for p in spec.split(","):
        a, b = p.split("/")
        out.append((int(a), int(b)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--kv", default="f16,q8_0")
    ap.add_argument("--pairs", default="2/2,2/1,2/3,2/4,2/8,1/2,3/2,4/2,8/2",
                    help="prefill/decode thread counts; the first gives the reference")
    ap.add_argument("--lengths", default="100,600,1100,1900",
                    help="prompt lengths (about, in tokens)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    samplings = [("greedy", None), ("seeded", args.seed)]
    lengths = [int(n) for n in args.lengths.split(",")]
    failures = 0
    print("| model | KV | prefill / decode threads | prompt tokens | answers identical "
          "to the reference | first differences |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as logdir:
        for name in args.models.split(","):
            model = os.path.join(ROOT, "models", MODELS[name])
            for kv in args.kv.split(","):
                reference = {}
                for pt, dt in pairs(args.pairs):
                    same, total, diffs, tokens = 0, 0, [], []
                    with Stack(model, kv, pt, dt, logdir) as stack:
                        for n in lengths:
                            text = prompt(n)
                            for sname, seed in samplings:
                                for transport, handoff in TRANSPORTS:
                                    a = ask(stack.url, text, transport, handoff, seed,
                                            args.max_tokens)
                                    key = (n, sname)
                                    reference.setdefault(key, a)
                                    if transport == "local" and sname == "greedy":
                                        tokens.append(a["prompt_tokens"])
                                    total += 1
                                    d = first_difference(reference[key], a)
                                    if d is None:
                                        same += 1
                                    else:
                                        diffs.append(f"{a['prompt_tokens']} {sname} "
                                                     f"{transport}{'/' + handoff if handoff else ''}"
                                                     f" at {d}")
                    failures += total - same
                    print(f"| {name} | {kv} | {pt} / {dt} | {', '.join(map(str, tokens))} | "
                          f"{same}/{total} | {'; '.join(diffs) or '-'} |", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
