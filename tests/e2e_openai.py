#!/usr/bin/env python3
"""End-to-end: the official `openai` Python client (and curl) through a `gorgo node`.

Starts `gorgo engine` (the emulator) and `gorgo node` from the built binary on free
127.0.0.1 ports, then drives chat and completions, streaming and not, checks the
`x-gorgo-*` headers with `with_raw_response`, checks OpenAI error JSON for bad input,
and stops both. Exit status is non-zero on any failure.

    python3 tests/e2e_openai.py target/debug/gorgo
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai

from e2e_util import check, node_setup

ADMIN_TOKEN = "e2e-admin-token"
NODE_ID = "e2e-region"


def wait_until(what, check, procs, timeout_s=60.0):
    """Poll `check` until it is true; fail early if a child process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited early with {p.returncode}")
        try:
            if check():
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def http_status(url, data=None, headers=None, method=None):
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def run(binary):
    node = node_setup(binary, NODE_ID, ADMIN_TOKEN, "gorgo-e2e-")
    tmp, config_path = node.tmp, node.config_path
    engine_port, http_port, admin_port = node.engine_port, node.http_port, node.admin_port

    logs = open(os.path.join(tmp, "log.txt"), "w")
    procs = []
    try:
        procs.append(subprocess.Popen(
            [binary, "engine", "--profile", "paper-a100-mistral7b",
             "--listen", f"127.0.0.1:{engine_port}", "--model", "e2e-model"],
            stdout=logs, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([binary, "node", "--config", config_path],
                                      stdout=logs, stderr=subprocess.STDOUT))
        admin = f"http://127.0.0.1:{admin_port}"
        wait_until("engine health",
                   lambda: http_status(f"http://127.0.0.1:{engine_port}/health")[0] == 200, procs)
        wait_until("node readiness", lambda: http_status(f"{admin}/readyz")[0] == 200, procs)

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        messages = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Say hello in five words."}]

        models = client.models.list()
        check(any(m.id == "e2e-model" for m in models.data), f"models: {models}")

        raw = client.chat.completions.with_raw_response.create(
            model="e2e-model", messages=messages, max_tokens=8)
        check(raw.headers.get("x-gorgo-served-by") == NODE_ID, f"served-by: {raw.headers}")
        check(raw.headers.get("x-gorgo-hops") == "0", f"hops: {raw.headers}")
        chat = raw.parse()
        check(chat.choices and chat.choices[0].message.content, f"chat: {chat}")

        raw = client.chat.completions.with_raw_response.create(
            model="e2e-model", messages=messages, max_tokens=8, stream=True)
        check(raw.headers.get("x-gorgo-served-by") == NODE_ID, f"served-by: {raw.headers}")
        check(raw.headers.get("content-type", "").startswith("text/event-stream"),
              f"content-type: {raw.headers}")
        pieces = [c.choices[0].delta.content or "" for c in raw.parse() if c.choices]
        check(len(pieces) >= 2 and "".join(pieces), f"chat stream: {pieces}")

        raw = client.completions.with_raw_response.create(
            model="e2e-model", prompt="Once upon a time", max_tokens=8)
        check(raw.headers.get("x-gorgo-hops") == "0", f"hops: {raw.headers}")
        comp = raw.parse()
        check(comp.choices and comp.choices[0].text, f"completion: {comp}")

        raw = client.completions.with_raw_response.create(
            model="e2e-model", prompt="Once upon a time", max_tokens=8, stream=True)
        check(raw.headers.get("x-gorgo-served-by") == NODE_ID, f"served-by: {raw.headers}")
        texts = [c.choices[0].text for c in raw.parse() if c.choices]
        check(len(texts) >= 2 and "".join(texts), f"completion stream: {texts}")

        # Bad input: the client raises typed errors carrying OpenAI error JSON.
        try:
            client.chat.completions.create(model="e2e-model", messages="not a list", max_tokens=8)
            raise AssertionError("malformed request accepted")
        except openai.BadRequestError as e:
            check(e.status_code == 400, f"400: {e}")
        status, body = http_status(f"http://127.0.0.1:{http_port}/v1/nope")
        check(status == 404 and "error" in json.loads(body), f"404: {status} {body}")
        status, body = http_status(f"{admin}/admin/state")
        check(status == 401, f"admin without token: {status}")
        status, body = http_status(f"{admin}/admin/state",
                                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        check(status == 200 and json.loads(body)["node"] == NODE_ID, f"admin state: {body}")
        status, body = http_status(f"{admin}/metrics")
        check(status == 200 and b"gorgo_requests_total" in body, "metrics")

        # curl, the other real client: a streaming chat request stays SSE end to end.
        curl = subprocess.run(
            ["curl", "-sS", "-N", "-D", "-", "--max-time", "30",
             f"http://127.0.0.1:{http_port}/v1/chat/completions",
             "-H", "content-type: application/json",
             "-d", json.dumps({"model": "e2e-model", "stream": True, "max_tokens": 8,
                               "messages": [{"role": "user", "content": "hello from curl"}]})],
            capture_output=True, text=True, timeout=60)
        check(curl.returncode == 0, f"curl failed: {curl.stderr}")
        out = curl.stdout.lower()
        check("text/event-stream" in out, f"curl: not SSE: {curl.stdout[:300]}")
        check(f"x-gorgo-served-by: {NODE_ID}" in out, f"curl: served-by header: {curl.stdout[:300]}")
        check("data: [done]" in out, f"curl: stream did not end with [DONE]: {curl.stdout[-300:]}")
        check(out.count("data: {") >= 2, f"curl: expected several SSE chunks: {curl.stdout[-300:]}")
        print("e2e_openai: ok (openai client and curl)")
    except Exception:
        logs.flush()
        print(f"e2e_openai: process logs in {logs.name}", file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        logs.close()


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        run(os.path.abspath(sys.argv[1]))
    except Exception as e:  # noqa: BLE001 - report any failure as a non-zero exit
        print(f"e2e_openai: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
