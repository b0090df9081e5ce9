#!/usr/bin/env python3
"""Sequential latency client for scripts/proxy-bench.sh.

Sends the same request set to several OpenAI-compatible targets (the engine itself,
a `gorgo node` in front of it, SGLang's router in front of it), one request at a
time, interleaving the targets (the order rotates every round) so that machine noise
hits all of them alike. Timing is on raw sockets with time.perf_counter: TTFT is the
first byte of the response body (for a streaming response, the first SSE chunk), E2E
the end of the body. Each target keeps one keep-alive connection with TCP_NODELAY,
as a real client would.

Added latency of a proxy = its percentile minus the direct percentile (p50, p99),
and, per request, the p50 and p99 of (proxy latency - direct latency of the same
prompt in the same round). Writes a JSON file with every figure; prints a table.
"""

import argparse
import json
import random
import socket
import sys
import time


class HttpError(Exception):
    """A response we cannot use (bad status, broken framing)."""


class Conn:
    """One keep-alive HTTP/1.1 connection to a target, timed at the byte level."""

    def __init__(self, host, port):
        self.host, self.port = host, port
        self.sock = None
        self.buf = b""

    def _connect(self):
        self.sock = socket.create_connection((self.host, self.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def close(self):
        if self.sock is not None:
            self.sock.close()
        self.sock = None

    def _fill(self):
        data = self.sock.recv(65536)
        if not data:
            raise HttpError("connection closed by the server")
        self.buf += data

    def request(self, path, body):
        """POST body; returns (status, ttft_s, e2e_s, body_bytes)."""
        if self.sock is None:
            self._connect()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: */*\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        t0 = time.perf_counter()
        self.sock.sendall(head + body)
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        raw_head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        ttft = None
        body_bytes = bytearray()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                while b"\r\n" not in self.buf:
                    self._fill()
                size_line, self.buf = self.buf.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while b"\r\n" not in self.buf:
                        self._fill()
                    _, self.buf = self.buf.split(b"\r\n", 1)
                    break
                if ttft is None:
                    # The chunk header is here: its first bytes are (or are in) the buffer.
                    while not self.buf:
                        self._fill()
                    ttft = time.perf_counter() - t0
                while len(self.buf) < size + 2:
                    self._fill()
                body_bytes += self.buf[:size]
                self.buf = self.buf[size + 2 :]
        elif "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < max(n, 1) and n > 0:
                self._fill()
            if n > 0:
                ttft = time.perf_counter() - t0
            while len(self.buf) < n:
                self._fill()
            body_bytes += self.buf[:n]
            self.buf = self.buf[n:]
        else:
            # Body until close.
            try:
                while True:
                    if self.buf and ttft is None:
                        ttft = time.perf_counter() - t0
                    self._fill()
            except HttpError:
                pass
            body_bytes += self.buf
            self.close()
        e2e = time.perf_counter() - t0
        if headers.get("connection", "").lower() == "close":
            self.close()
        if ttft is None:
            ttft = e2e
        return status, ttft, e2e, bytes(body_bytes)


def percentile(values, p):
    """Nearest-rank percentile (the project's definition, gorgo_core::sketch::percentile)."""
    if not values:
        return float("nan")
    s = sorted(values)
    rank = max(1, -(-len(s) * p // 100))  # ceil(p/100 * n), at least 1
    return s[int(rank) - 1]


def output_tokens(data, stream):
    """Completion tokens in a response: content deltas (stream) or usage (JSON)."""
    if stream:
        return data.count(b'"content"') - data.count(b'"content":""')
    try:
        return json.loads(data)["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError):
        return -1


def make_prompts(n, seed):
    """n distinct chat prompts of 200 to 4000 bytes (deterministic)."""
    rng = random.Random(seed)
    words = ("route cache prefix region token queue gossip latency peer engine "
             "prefill decode stream summary weight epoch").split()
    prompts = []
    for i in range(n):
        length = rng.randint(200, 4000)
        text = f"request {i}: "
        while len(text) < length:
            text += rng.choice(words) + " "
        prompts.append(text[:length])
    return prompts


def body_for(prompt, stream, max_tokens, model):
    return json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }).encode()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="append", required=True,
                    help="name=host:port; the first is the direct (reference) target")
    ap.add_argument("--requests", type=int, default=300, help="requests per target per mode")
    ap.add_argument("--warmup", type=int, default=20, help="untimed rounds first")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--modes", default="nonstream,stream")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", required=True, help="JSON output file")
    args = ap.parse_args()

    targets = []
    for spec in args.target:
        name, _, addr = spec.partition("=")
        host, _, port = addr.rpartition(":")
        targets.append((name, Conn(host, int(port))))
    direct = targets[0][0]
    prompts = make_prompts(args.requests, args.seed)
    results = {"config": vars(args), "modes": {}}

    modes = args.modes.split(",")
    state = {}
    for mode in modes:
        state[mode] = {
            "samples": {name: {"ttft": [], "e2e": []} for name, _ in targets},
            "paired": {name: {"ttft": [], "e2e": []} for name, _ in targets[1:]},
            "errors": {name: 0 for name, _ in targets},
            "tokens": {name: set() for name, _ in targets},
        }
    # Rounds interleave modes as well as targets, so that a burst of load from
    # elsewhere on the machine hits every (mode, target) alike.
    for rnd in range(-args.warmup, args.requests):
        prompt = prompts[rnd % len(prompts)]
        for mode in modes:
            stream = mode == "stream"
            st = state[mode]
            body = body_for(prompt, stream, args.max_tokens, args.model)
            order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
            got = {}
            for name, conn in order:
                try:
                    status, ttft, e2e, data = conn.request("/v1/chat/completions", body)
                except (OSError, HttpError, ValueError) as e:
                    conn.close()
                    st["errors"][name] += 1
                    print(f"{mode} {name}: {e}", file=sys.stderr)
                    continue
                if status != 200 or (stream and b"[DONE]" not in data):
                    st["errors"][name] += 1
                    print(f"{mode} {name}: status {status}: {data[:200]!r}", file=sys.stderr)
                    continue
                got[name] = (ttft, e2e)
                st["tokens"][name].add(output_tokens(data, stream))
            if rnd < 0:
                continue
            for name, (ttft, e2e) in got.items():
                st["samples"][name]["ttft"].append(ttft * 1000)
                st["samples"][name]["e2e"].append(e2e * 1000)
            if direct in got:
                for name in st["paired"]:
                    if name in got:
                        st["paired"][name]["ttft"].append((got[name][0] - got[direct][0]) * 1000)
                        st["paired"][name]["e2e"].append((got[name][1] - got[direct][1]) * 1000)

    for mode in modes:
        samples, paired = state[mode]["samples"], state[mode]["paired"]
        errors, tokens = state[mode]["errors"], state[mode]["tokens"]
        out = {}
        for name, _ in targets:
            row = {"requests": len(samples[name]["e2e"]), "errors": errors[name],
                   "output_tokens_seen": sorted(tokens[name])}
            if tokens[name] != {args.max_tokens}:
                # A proxy that rewrites the request (e.g. max_tokens) is not comparable.
                print(f"{mode} {name}: output tokens {sorted(tokens[name])}, "
                      f"expected {args.max_tokens}", file=sys.stderr)
                row["errors"] += 1
            for metric in ("ttft", "e2e"):
                vals = samples[name][metric]
                row[f"{metric}_ms"] = {
                    "p50": percentile(vals, 50), "p99": percentile(vals, 99),
                    "mean": sum(vals) / len(vals) if vals else float("nan"),
                }
                if name != direct:
                    d = samples[direct][metric]
                    row[f"added_{metric}_ms"] = {
                        "p50": percentile(vals, 50) - percentile(d, 50),
                        "p99": percentile(vals, 99) - percentile(d, 99),
                        "paired_p50": percentile(paired[name][metric], 50),
                        "paired_p99": percentile(paired[name][metric], 99),
                    }
            row["samples_ms"] = samples[name]
            out[name] = row
        results["modes"][mode] = out

    for _, conn in targets:
        conn.close()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    for mode, out in results["modes"].items():
        print(f"\n{mode} (sequential, {args.requests} requests per target, ms)")
        print(f"{'target':<8} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9} {'E2E p99':>9} {'err':>4}")
        for name, row in out.items():
            print(f"{name:<8} {row['ttft_ms']['p50']:>9.3f} {row['ttft_ms']['p99']:>9.3f} "
                  f"{row['e2e_ms']['p50']:>9.3f} {row['e2e_ms']['p99']:>9.3f} {row['errors']:>4}")
        print(f"added over direct (percentile difference; per-request paired difference)")
        print(f"{'target':<8} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9} {'E2E p99':>9}"
              f" {'pair TTFT p50':>14} {'pair TTFT p99':>14} {'pair E2E p50':>13} {'pair E2E p99':>13}")
        for name, row in out.items():
            if name == direct:
                continue
            t, e = row["added_ttft_ms"], row["added_e2e_ms"]
            print(f"{name:<8} {t['p50']:>9.3f} {t['p99']:>9.3f} {e['p50']:>9.3f} {e['p99']:>9.3f}"
                  f" {t['paired_p50']:>14.3f} {t['paired_p99']:>14.3f}"
                  f" {e['paired_p50']:>13.3f} {e['paired_p99']:>13.3f}")
    bad = sum(row["errors"] for out in results["modes"].values() for row in out.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
