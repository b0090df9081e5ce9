#!/usr/bin/env python3
"""Calibrate a llama.cpp server the way an operator would before pointing GORGO at it.

Usage: real_engine_calibrate.py ENGINE_URL [--out FILE]

Sends cold prompts (text no earlier prompt shares) of several lengths, streaming, one
at a time, and fits TTFT = base + t_p x prompt_tokens by least squares, with prompt
tokens as the engine counts them (`usage.prompt_tokens` of the same prompt sent again
without streaming): what the node counts too, with the model's tokenizer or by learning
the ratio from the engine (docs/node.md, "Tokens"). Also measures the decode step,
(E2E - TTFT) / (tokens - 1). Prints one
JSON object {"t_p_ms", "base_ms", "decode_step_ms", "samples": [...]}: the seeds of each
node's online fit (`gorgo up --engine-t-p-ms/--engine-base-ms/--engine-decode-step-ms`),
which the nodes then refine from their own traffic.
"""
import argparse
import json
import random
import sys
import time
import urllib.request

# Prompt sizes are chosen in 4-byte units (the workload generator's token model); the fit
# is over the engine's own counts.
BYTES_PER_TOKEN = 4
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ba", "de", "fi", "go", "hu", "je"]
LENGTHS = [100, 300, 500, 700, 900]  # node tokens: the workload's range
OUTPUT_TOKENS = 16


def cold_text(rng, node_tokens):
    words = []
    size = 0
    while size < node_tokens * BYTES_PER_TOKEN:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[: node_tokens * BYTES_PER_TOKEN]


def engine_tokens(url, text):
    """The engine's `usage.prompt_tokens` for the chat prompt `text`."""
    body = json.dumps({
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
    }).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["usage"]["prompt_tokens"]


def timed_stream(url, text):
    body = json.dumps({
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": OUTPUT_TOKENS,
        "stream": True,
    }).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    start = time.monotonic()
    first = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0].get("delta", {})
            if delta.get("content") is not None:
                chunks += 1
                if first is None:
                    first = time.monotonic()
    end = time.monotonic()
    if first is None:
        raise RuntimeError("no content chunk in the stream")
    return (first - start) * 1000.0, (end - start) * 1000.0, chunks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    url = a.url.rstrip("/")
    rng = random.Random(a.seed)
    timed_stream(url, cold_text(rng, 50))  # first call pays one-time setup
    samples = []
    for n in LENGTHS:
        text = cold_text(rng, n)
        ttft, e2e, chunks = timed_stream(url, text)
        samples.append({"bytes": len(text), "prompt_tokens": engine_tokens(url, text),
                        "ttft_ms": round(ttft, 1), "e2e_ms": round(e2e, 1), "chunks": chunks})
    xs = [s["prompt_tokens"] for s in samples]
    ys = [s["ttft_ms"] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    t_p = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    t_p = max(t_p, 0.01)
    base = max(my - t_p * mx, 0.0)
    steps = [(s["e2e_ms"] - s["ttft_ms"]) / (s["chunks"] - 1) for s in samples if s["chunks"] > 1]
    decode = max(sum(steps) / len(steps), 0.1) if steps else 20.0
    print(json.dumps({"t_p_ms": round(t_p, 4), "base_ms": round(base, 1),
                      "decode_step_ms": round(decode, 2), "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
