#!/usr/bin/env python3
"""Minimal OpenAI-compatible engine for scripts/proxy-bench.sh: answers at once.

`gorgo engine` paces its output on tokio's 1 ms timer, so its own latency moves by up
to a millisecond with the arrival phase. This server has no timer at all: it answers
a chat/completions request as soon as the body is read, a JSON object or, when
streaming, every SSE chunk written back to back (one send each, TCP_NODELAY), which
is the pattern that shows a proxy's Nagle/delayed-ACK stalls. Its latency is the
same for every target, so proxy - direct isolates the proxy. One asyncio loop; keep-alive;
`/health`, `/v1/models`, `/get_model_info`, `/get_server_info` for routers' checks.
"""

import argparse
import asyncio
import json
import socket
import time

MODEL = "bench"


def chunk(payload):
    data = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def completion_body(n_tokens, prompt_tokens):
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                     "message": {"role": "assistant", "content": "tok " * n_tokens}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                  "total_tokens": prompt_tokens + n_tokens,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }).encode()


def stream_chunks(n_tokens, prompt_tokens):
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": MODEL}
    out = []
    for i in range(n_tokens):
        delta = {"content": "tok "}
        if i == 0:
            delta["role"] = "assistant"
        out.append(chunk(json.dumps(dict(base, choices=[
            {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])).encode()))
    out.append(chunk(json.dumps(dict(base, choices=[
        {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}],
        usage={"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
               "total_tokens": prompt_tokens + n_tokens,
               "prompt_tokens_details": {"cached_tokens": 0}})).encode()))
    out.append(chunk(b"[DONE]"))
    out.append(b"0\r\n\r\n")
    return out


def simple(status, body, ctype=b"application/json"):
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            % (status, ctype, len(body))) + body


async def handle(reader, writer):
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split()[:2]
            length = 0
            for line in lines[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v.strip())
            body = await reader.readexactly(length) if length else b""
            if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                try:
                    req = json.loads(body)
                except ValueError:
                    writer.write(simple(b"400 Bad Request", b'{"error":{"message":"bad json"}}'))
                    continue
                n = max(1, int(req.get("max_completion_tokens") or req.get("max_tokens") or 16))
                prompt_tokens = max(1, len(body) // 4)
                if req.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
                    for piece in stream_chunks(n, prompt_tokens):
                        writer.write(piece)  # one send per chunk: back to back
                else:
                    writer.write(simple(b"200 OK", completion_body(n, prompt_tokens)))
            elif path in ("/health", "/health_generate"):
                writer.write(simple(b"200 OK", b""))
            elif path == "/v1/models":
                writer.write(simple(b"200 OK", json.dumps(
                    {"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()))
            elif path in ("/get_model_info", "/model_info"):
                writer.write(simple(b"200 OK", json.dumps(
                    {"model_path": MODEL, "is_generation": True}).encode()))
            elif path in ("/get_server_info", "/server_info"):
                writer.write(simple(b"200 OK", b"{}"))
            else:
                writer.write(simple(b"404 Not Found", b'{"error":{"message":"not found"}}'))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError, IndexError):
        pass
    finally:
        writer.close()


async def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="127.0.0.1:30000")
    args = ap.parse_args()
    host, _, port = args.listen.rpartition(":")
    server = await asyncio.start_server(handle, host, int(port), limit=1 << 24)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
