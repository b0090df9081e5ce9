#!/usr/bin/env python3
"""The official `openai` client through a GORGO node to a llama.cpp engine and back.

Usage: real_engine_openai_check.py NODE_URL ENGINE_URL

Sends the same chat request, non-streaming and streaming, once straight to the engine
and once through the node (with `x-gorgo-policy: local-only`, so the node in front of
this engine serves it), and checks the two answers are the same: content, finish
reason, usage, model and, for streams, the sequence of chunks. Fields that differ on
every call by design (`id`, `created`) are left out of the comparison.

A llama.cpp server keeps one context: whether a prompt's prefix is already cached
changes the floating-point path, so a random-weight model's greedy output can differ
between a cold and a warm call. Each request is therefore sent once to warm the
engine, then engine, node, engine again: the three calls see the same cache state, and
the node's answer must equal the engine's.
"""
import json
import sys

import openai

PROMPT = (
    "You are a careful assistant. Summarise the following notes in one line. "
    "the water was long and the people could see the day come down the way it had "
    "before, and many of them made their way out into the time that was theirs."
)
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": PROMPT},
]
PARAMS = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0, seed=7)
NODE_HEADERS = {"x-gorgo-policy": "local-only"}


def fail(msg):
    print(f"openai check FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def plain(completion):
    d = completion.model_dump()
    d.pop("id", None)
    d.pop("created", None)
    return d


def stream_chunks(client, headers):
    chunks = []
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, extra_headers=headers, **PARAMS
    ):
        d = chunk.model_dump()
        d.pop("id", None)
        d.pop("created", None)
        chunks.append(d)
    return chunks


def stream_text(chunks):
    return "".join(
        (c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices")
    )


def main():
    if len(sys.argv) != 3:
        fail("usage: real_engine_openai_check.py NODE_URL ENGINE_URL")
    node_url, engine_url = sys.argv[1].rstrip("/"), sys.argv[2].rstrip("/")
    node = openai.OpenAI(base_url=node_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    engine = openai.OpenAI(base_url=engine_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    # Non-streaming.
    engine.chat.completions.create(**PARAMS)  # warm the engine's context
    direct = plain(engine.chat.completions.create(**PARAMS))
    via_node = plain(node.chat.completions.create(extra_headers=NODE_HEADERS, **PARAMS))
    direct_again = plain(engine.chat.completions.create(**PARAMS))
    if direct != direct_again:
        fail(f"the engine itself is not deterministic here:\n{direct}\n{direct_again}")
    if via_node != direct:
        fail(f"non-streaming answer changed by the node:\nengine: {direct}\nnode:   {via_node}")
    text = direct["choices"][0]["message"]["content"]
    print(f"non-streaming: identical ({direct['usage']['prompt_tokens']} prompt tokens, "
          f"{direct['usage']['completion_tokens']} completion tokens, {text!r})")

    # Streaming (with the usage chunk).
    stream_chunks(engine, {})
    direct_s = stream_chunks(engine, {})
    node_s = stream_chunks(node, NODE_HEADERS)
    direct_s_again = stream_chunks(engine, {})
    if direct_s != direct_s_again:
        fail("the engine's stream is not deterministic here")
    if node_s != direct_s:
        for i, (a, b) in enumerate(zip(direct_s, node_s)):
            if a != b:
                fail(f"stream chunk {i} changed by the node:\nengine: {json.dumps(a)}\nnode:   {json.dumps(b)}")
        fail(f"stream length changed by the node: engine {len(direct_s)} chunks, node {len(node_s)}")
    print(f"streaming:     identical ({len(node_s)} chunks, {stream_text(node_s)!r})")

    # The node's own error path keeps OpenAI's error shape for the client.
    try:
        node.chat.completions.create(model="tiny", messages="not a list", max_tokens=1)
        fail("a malformed body was accepted")
    except openai.BadRequestError as e:
        print(f"malformed body: {e.status_code} as openai.BadRequestError")
    print("openai check passed")


if __name__ == "__main__":
    main()
