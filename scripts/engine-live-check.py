#!/usr/bin/env python3
"""Live TTFT check of an OpenAI-compatible engine (the gorgo emulator or a real one).

Sends N sequential streaming chat requests of increasing prompt length, fits
TTFT = base + slope x prompt_tokens, repeats the longest prompt to see the prefix
cache, and checks /metrics for SGLang's gauge names. Standard library only.

  scripts/engine-live-check.py --url http://127.0.0.1:30000
  scripts/engine-live-check.py --spawn target/debug/gorgo --profile paper-a100-mistral7b

Exit status 0 when slope is within --tolerance of --expect-slope and R^2 >= --min-r2.
"""
import argparse
import http.client
import json
import random
import socket
import string
import subprocess
import sys
import time
import urllib.parse
import urllib.request


def stream_chat(url, content, max_tokens):
    """Returns (ttft_ms, usage dict) for one streaming chat completion."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft = None
    usage = None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or choice.get("text")
            if text and ttft is None:
                ttft = (time.perf_counter() - start) * 1000.0
        if chunk.get("usage"):
            usage = chunk["usage"]
    conn.close()
    return ttft, usage or {}


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, 1.0 - ss_res / ss_tot


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--spawn", help="path of the gorgo binary: start `gorgo engine` on a free port")
    ap.add_argument("--profile", default="paper-a100-mistral7b")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--min-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=8000)
    ap.add_argument("--expect-slope", type=float, default=0.0938)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--min-r2", type=float, default=0.97)
    args = ap.parse_args()

    proc = None
    url = args.url.rstrip("/")
    if args.spawn:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([args.spawn, "engine", "--profile", args.profile, "--listen", f"127.0.0.1:{port}"])
    try:
        wait_healthy(url)
        rng = random.Random(7)
        xs, ys, last = [], [], ""
        n = args.requests
        for i in range(n):
            tokens = args.min_tokens + (i * (args.max_tokens - args.min_tokens)) // max(n - 1, 1)
            last = "".join(rng.choice(string.ascii_lowercase) for _ in range(tokens * 4))
            ttft, usage = stream_chat(url, last, 1)
            xs.append(float(usage.get("prompt_tokens", tokens)))
            ys.append(ttft)
            print(f"{int(xs[-1]):6d} tokens  TTFT {ttft:8.1f} ms  cached {usage.get('prompt_tokens_details', {}).get('cached_tokens')}")
        a, b, r2 = fit(xs, ys)
        print(f"fit: TTFT = {a:.2f} ms + {b:.5f} ms/token, R^2 {r2:.4f}")
        ttft2, usage2 = stream_chat(url, last, 4)
        cached = (usage2.get("prompt_tokens_details") or {}).get("cached_tokens")
        print(f"repeat of the longest prompt: TTFT {ttft2:.1f} ms (was {ys[-1]:.1f}), cached_tokens {cached}")
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        missing = [m for m in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens",
                               "sglang:token_usage", "sglang:cache_hit_rate", "sglang:max_total_num_tokens",
                               "sglang:time_to_first_token_seconds") if m not in metrics]
        ok = abs(b / args.expect_slope - 1.0) <= args.tolerance and r2 >= args.min_r2 and not missing
        if missing:
            print("missing metrics:", ", ".join(missing))
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
