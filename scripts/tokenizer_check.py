#!/usr/bin/env python3
"""How far the node's prompt-token count is from llama.cpp's own, on real chat prompts.

One llama.cpp server (llama-cpp-python, tiny_gguf.py's model, `--chat_format chatml` as
scripts/real-engine-e2e.sh runs it) and one `gorgo node` in front of it, twice: with the
model's tokenizer (exported by scripts/gguf_tokenizer.py, the chat template that
llama-cpp-python really applies: configs/templates/llama-cpp-python-chatml.jinja) and
without (the ratio learned from the engine's `usage.prompt_tokens`). Each of the chat
prompts of scripts/chat_prompts.py is sent once, non-streamed; the engine's
`usage.prompt_tokens` is compared with the node's count (`/admin/decisions`).

    ~/.cache/gorgo/llama-venv/bin/python scripts/tokenizer_check.py [--out DIR] [--n 80]
        [--gorgo target/release/gorgo] [--venv ~/.cache/gorgo/llama-venv]

Writes DIR/report.json and prints a summary: with the tokenizer, the exact-match rate
and mean/max relative error; with the ratio, the mean/max error of requests 51 on, and
the first request's error (the 4-bytes-per-token seed). Not a CI test: it needs the
llama-cpp-python venv (docs/real-engine.md).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "tokenizer-check-token"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, token=None, timeout=300):
    req = urllib.request.Request(url, method=method, data=body)
    if body is not None:
        req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url, proc, what, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"tokenizer_check: {what} exited ({proc.returncode})")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception:
            time.sleep(0.2)
    sys.exit(f"tokenizer_check: {what} not ready after {seconds}s")


def node_config(out, engine_url, tokenizer_dir):
    ports = [free_port() for _ in range(3)]
    engine = [f'url = "{engine_url}"', 'kind = "openai"', 'health_path = "/docs"',
              "metrics_interval_ms = 0", "health_interval_ms = 2000", "health_timeout_ms = 5000"]
    if tokenizer_dir:
        engine += [f'tokenizer = "{tokenizer_dir}/tokenizer.json"',
                   f'chat_template = "{ROOT}/configs/templates/llama-cpp-python-chatml.jinja"',
                   "chat_add_special_tokens = true"]
    text = "\n".join([
        "[node]", 'id = "a"', 'region = "a"',
        "[listen]", f'http = "127.0.0.1:{ports[0]}"', f'quic = "127.0.0.1:{ports[1]}"',
        f'admin = "127.0.0.1:{ports[2]}"',
        "[engine]", *engine,
        "[tls]", f'ca = "{out}/certs/ca.pem"', f'cert = "{out}/certs/a.pem"', f'key = "{out}/certs/a.key"',
        "[admin]", f'token = "{TOKEN}"',
        "[limits]", "first_byte_timeout_ms = 600000", "request_timeout_ms = 600000", "",
    ])
    name = "node-tokenizer.toml" if tokenizer_dir else "node-ratio.toml"
    path = os.path.join(out, name)
    with open(path, "w") as f:
        f.write(text)
    return path, f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[2]}"


def run_node(gorgo, out, engine_url, tokenizer_dir, prompts):
    path, base, admin = node_config(out, engine_url, tokenizer_dir)
    log = open(path.replace(".toml", ".log"), "w")
    proc = subprocess.Popen([gorgo, "node", "--config", path], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"{admin}/readyz", proc, "gorgo node")
        rows = []
        for i, body in enumerate(prompts):
            resp = http("POST", f"{base}/v1/chat/completions", body.encode())
            engine = resp["usage"]["prompt_tokens"]
            node = http("GET", f"{admin}/admin/decisions?limit=1", token=TOKEN)[0]["prompt_tokens"]
            rows.append({"i": i, "engine": engine, "node": node, "bytes": len(body)})
            print(f"  {'tokenizer' if tokenizer_dir else 'ratio'} {i}: node {node} engine {engine}", flush=True)
        state = http("GET", f"{admin}/admin/state", token=TOKEN)
        return rows, state["tokens"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def errors(rows):
    return [abs(r["node"] - r["engine"]) / r["engine"] for r in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "tokenizer-check"))
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--gorgo", default=None)
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/gorgo/llama-venv"))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    gorgo = a.gorgo or next((p for p in (os.path.join(target, "release", "gorgo"),
                                         os.path.join(target, "debug", "gorgo")) if os.path.exists(p)), None)
    if not gorgo:
        sys.exit("tokenizer_check: no gorgo binary (cargo build --release, or --gorgo PATH)")
    py = os.path.join(a.venv, "bin", "python")
    tools = next((p for p in (os.path.join(ROOT, "..", "shared", "tools"), "/work/shared/tools")
                  if os.path.exists(os.path.join(p, "tiny_gguf.py"))), None)
    if not tools:
        sys.exit("tokenizer_check: shared/tools/tiny_gguf.py not found")
    model = os.path.join(out, "tiny.gguf")
    subprocess.run([py, os.path.join(tools, "tiny_gguf.py"), model, "--ctx", "8192", "--seed", "0"], check=True)
    tok_dir = os.path.join(out, "tokenizer")
    subprocess.run([py, os.path.join(ROOT, "scripts", "gguf_tokenizer.py"), model, tok_dir], check=True)
    prompts_path = os.path.join(out, "chat-prompts.jsonl")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chat_prompts.py"), prompts_path,
                    "--n", str(a.n)], check=True)
    prompts = []
    for line in open(prompts_path, encoding="utf-8"):
        body = json.loads(line)
        body["max_tokens"] = 1
        prompts.append(json.dumps(body, ensure_ascii=False))
    subprocess.run([gorgo, "certs", "--out", os.path.join(out, "certs"), "--nodes", "a"], check=True,
                   stdout=subprocess.DEVNULL)

    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    llama_log = open(os.path.join(out, "llama.log"), "w")
    llama = subprocess.Popen(
        [py, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
         "--n_ctx", "8192", "--chat_format", "chatml", "--n_threads", str(a.threads),
         "--n_threads_batch", str(a.threads), "--interrupt_requests", "False"],
        stdout=llama_log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"{engine_url}/v1/models", llama, "llama server", seconds=300)
        with_tok, tok_view = run_node(gorgo, out, engine_url, tok_dir, prompts)
        with_ratio, ratio_view = run_node(gorgo, out, engine_url, None, prompts)
    finally:
        llama.terminate()
        llama.wait(timeout=30)

    e_tok = errors(with_tok)
    e_ratio = errors(with_ratio)
    late = e_ratio[50:]
    report = {
        "requests": len(prompts),
        "engine_tokens": sum(r["engine"] for r in with_tok),
        "prompt_body_bytes": sum(r["bytes"] for r in with_tok),
        "tokenizer": {
            "exact": sum(r["node"] == r["engine"] for r in with_tok),
            "mean_error": sum(e_tok) / len(e_tok),
            "max_error": max(e_tok),
            "view": tok_view,
            "rows": with_tok,
        },
        "ratio": {
            "first_error": e_ratio[0],
            "mean_error_first_50": sum(e_ratio[:50]) / 50,
            "after_50": len(late),
            "mean_error_after_50": sum(late) / len(late) if late else None,
            "max_error_after_50": max(late) if late else None,
            "view": ratio_view,
            "rows": with_ratio,
        },
    }
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    t, r = report["tokenizer"], report["ratio"]
    print(f"requests {report['requests']}, engine prompt tokens {report['engine_tokens']} "
          f"for {report['prompt_body_bytes']} body bytes")
    print(f"tokenizer: {t['exact']}/{report['requests']} exact, mean error {100 * t['mean_error']:.2f}%, "
          f"max {100 * t['max_error']:.2f}%")
    if late:
        print(f"ratio: first request {100 * r['first_error']:.1f}% off; requests 51-{report['requests']}: "
              f"mean error {100 * r['mean_error_after_50']:.2f}%, max {100 * r['max_error_after_50']:.2f}%")
    for s in ratio_view.get("shapes", []):
        if s["samples"]:
            print(f"  learned {s['shape']}: {s['bytes_per_token']:.3f} bytes/token + "
                  f"{s['overhead_tokens']} tokens ({s['samples']} samples)")
    print(f"report: {out}/report.json")


if __name__ == "__main__":
    main()
