#!/usr/bin/env python3
"""End-to-end: a vLLM-format KV-event publisher drives a `gorgo node`.

The publisher is built only from vLLM's documented message classes
(`vllm/distributed/kv_events.py`: `EventBatch`, `BlockStored`, `BlockRemoved`,
`AllBlocksCleared`), re-declared here with `msgspec`, and speaks vLLM's ZeroMQ
protocol with `pyzmq`: PUB `[topic, seq (8-byte big-endian), payload]` and a ROUTER
answering replay requests with every buffered batch from the asked seq, then seq -1 and
an empty payload. No vLLM install. A reference model of the engine's block cache (16
tokens a block, SHA-256 digests as block hashes, as current vLLM sends) says what the
node's index must hold; the node is asked through `POST /admin/prefix_match` and
`/admin/state`, block for block, through evictions, a lost batch and its replay, a
publisher restart (speaking the older `array_like` encoding SGLang also uses) and a
clear. Exit status is non-zero on any failure.

    python3 tests/kv_events_vllm.py target/debug/gorgo
"""

import hashlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import msgspec
import zmq

from e2e_util import check, node_setup

ADMIN_TOKEN = "kv-events-admin-token"
NODE_ID = "kv-region"
ENGINE_BLOCK = 16
# The node hashes bytes in 256-byte blocks without a tokenizer: 64 "tokens" a block.
NODE_BLOCK = 64


# vLLM's message classes (current vLLM: structs encode as maps, tagged by `type`).
class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The same classes as older vLLM and SGLang declare them (`array_like=True`).
class OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class RefEngine:
    """An engine's prefix cache, plainly: blocks of 16 token ids keyed by a digest of
    (parent, tokens), stored in runs (one BlockStored per run of new blocks, parent the
    last block already cached), evicted leaf first."""

    def __init__(self, int_hashes=False):
        self.blocks = {}  # hash -> (parent, tokens)
        self.int_hashes = int_hashes

    def key(self, parent, tokens):
        digest = hashlib.sha256(repr((parent, tokens)).encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1 if self.int_hashes else digest

    def chain(self, prompt):
        parent, out = None, []
        for i in range(0, len(prompt) - len(prompt) % ENGINE_BLOCK, ENGINE_BLOCK):
            h = self.key(parent, tuple(prompt[i:i + ENGINE_BLOCK]))
            out.append((h, parent, prompt[i:i + ENGINE_BLOCK]))
            parent = h
        return out

    def store(self, prompt):
        new, run_parent = [], None
        for h, parent, tokens in self.chain(prompt):
            if h not in self.blocks:
                if not new:
                    run_parent = parent
                self.blocks[h] = (parent, tokens)
                new.append((h, tokens))
        if not new:
            return None
        return dict(block_hashes=[h for h, _ in new], parent_block_hash=run_parent,
                    token_ids=[t for _, ts in new for t in ts], block_size=ENGINE_BLOCK)

    def evict(self, h):
        assert not any(p == h for p, _ in self.blocks.values()), "leaves only"
        del self.blocks[h]
        return dict(block_hashes=[h])

    def matched_tokens(self, prompt):
        n = 0
        for h, _, tokens in self.chain(prompt):
            if h not in self.blocks:
                break
            n += len(tokens)
        return n

    def node_blocks(self):
        """The distinct node blocks (64-token prefixes) the engine fully holds."""
        held = set()
        for h in self.blocks:
            tokens, cur = [], h
            while cur is not None:
                parent, ts = self.blocks[cur]
                tokens[:0] = ts
                cur = parent
            for end in range(NODE_BLOCK, len(tokens) + 1, NODE_BLOCK):
                held.add(tuple(tokens[:end]))
        return len(held)


class Publisher:
    """vLLM's ZmqEventPublisher, as its docs describe it: PUB plus a replay ROUTER."""

    def __init__(self, ctx, pub_port=None, replay_port=None, old_encoding=False):
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.pub_port = self._bind(self.pub, pub_port)
        self.replay_port = self._bind(self.router, replay_port)
        self.old = old_encoding
        self.seq = 0
        self.buffer = []
        self.encoder = msgspec.msgpack.Encoder()

    @staticmethod
    def _bind(sock, port):
        if port is None:
            return sock.bind_to_random_port("tcp://127.0.0.1")
        # A closed socket's port is released by libzmq's IO thread a moment later.
        deadline = time.monotonic() + 10
        while True:
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
                return port
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def batch(self, events):
        if self.old:
            evs = []
            for kind, fields in events:
                if kind == "stored":
                    evs.append(OldBlockStored(**fields, lora_id=None))
                elif kind == "removed":
                    evs.append(OldBlockRemoved(**fields))
                else:
                    evs.append(OldAllBlocksCleared())
            return OldEventBatch(ts=time.time(), events=evs, data_parallel_rank=0)
        evs = []
        for kind, fields in events:
            if kind == "stored":
                evs.append(BlockStored(**fields, lora_id=None, medium="GPU", lora_name=None))
            elif kind == "removed":
                evs.append(BlockRemoved(**fields, medium="GPU"))
            else:
                evs.append(AllBlocksCleared())
        return KVEventBatch(ts=time.time(), events=evs, data_parallel_rank=0)

    def publish(self, events, lost=False):
        """Publish one batch; `lost`: it goes to the replay buffer only, as a batch a
        slow subscriber missed."""
        payload = self.encoder.encode(self.batch(events))
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not lost:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def serve_replays(self):
        while self.router.poll(0):
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self):
        self.pub.close(linger=0)
        self.router.close(linger=0)


def http(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"authorization": f"Bearer {ADMIN_TOKEN}",
                                          "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(what, cond, procs, publisher, timeout_s=60.0):
    """Poll `cond` (serving the publisher's replays meanwhile) until true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited early with {p.returncode}")
        publisher.serve_replays()
        try:
            if cond():
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


def run(binary):
    binary = os.path.abspath(binary)
    rng = random.Random(19)
    ctx = zmq.Context()
    publisher = Publisher(ctx)
    node = node_setup(binary, NODE_ID, ADMIN_TOKEN, "gorgo-kv-", engine_extra=(
        f'kv_events = "tcp://127.0.0.1:{publisher.pub_port}"\n'
        f'kv_events_replay = "tcp://127.0.0.1:{publisher.replay_port}"\n'))
    tmp, config_path, engine_port, admin_port = (
        node.tmp, node.config_path, node.engine_port, node.admin_port)
    admin = f"http://127.0.0.1:{admin_port}"
    logs = open(os.path.join(tmp, "log.txt"), "w")
    procs = []
    checks = 0

    def state():
        status, body = http(f"{admin}/admin/state")
        assert status == 200, body
        return json.loads(body)

    def held(prompt):
        status, body = http(f"{admin}/admin/prefix_match", {"token_ids": prompt})
        assert status == 200, body
        return json.loads(body)["blocks"]

    def matches(engine, prompts):
        """The node holds, block for block, what the engine holds."""
        s = state()
        kv = s["kv_events"]
        return (kv["source"] == "events"
                and kv["node_blocks"] == engine.node_blocks()
                and s["shadow_index_blocks"] == engine.node_blocks()
                and all(held(p) == engine.matched_tokens(p) // NODE_BLOCK for p in prompts))

    try:
        procs.append(subprocess.Popen(
            [binary, "engine", "--listen", f"127.0.0.1:{engine_port}"],
            stdout=logs, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([binary, "node", "--config", config_path], cwd=tmp,
                                      stdout=logs, stderr=subprocess.STDOUT))
        wait_until("node admin", lambda: http(f"{admin}/healthz")[0] == 200, procs, publisher)

        tokens = lambda n: [rng.randrange(1, 150_000) for _ in range(n)]
        base = tokens(256)
        p1, p2, p3 = base + tokens(128), base + tokens(192), tokens(320)
        prompts = [p1, p2, p3, p1[:200], p2[:300]]
        engine = RefEngine()
        publisher.publish([("stored", engine.store(p1))])
        publisher.publish([("stored", engine.store(p2))])

        # The node joins after those were sent (a PUB drops what no subscriber took):
        # an empty batch until it hears one, then its replay from 0 brings them.
        def heard_and_followed():
            if state()["kv_events"]["counters"]["batches"] == 0:
                publisher.publish([])
            return matches(engine, prompts)
        wait_until("the node to follow the publisher", heard_and_followed, procs, publisher)
        checks += 1
        print(f"   kv events e2e: check {checks} passed", flush=True)

        # An eviction (the last block of p1): node block 5 of p1 goes.
        last = engine.chain(p1)[-1][0]
        publisher.publish([("removed", engine.evict(last))])
        wait_until("the eviction", lambda: matches(engine, prompts), procs, publisher)
        check(held(p1) == 5, f"p1 holds {held(p1)} blocks")
        checks += 1
        print(f"   kv events e2e: check {checks} passed", flush=True)

        # A lost batch (a block of p2 evicted) and the next one: the gap is replayed.
        before = state()["kv_events"]["counters"]
        leaf = engine.chain(p2)[-1][0]
        publisher.publish([("removed", engine.evict(leaf))], lost=True)
        publisher.publish([("stored", engine.store(p3))])
        wait_until("the replay of the lost batch", lambda: matches(engine, prompts), procs,
                   publisher)
        counters = state()["kv_events"]["counters"]
        check(counters["gaps"] == before["gaps"] + 1, f"{counters}")
        check(counters["replays"] == before["replays"] + 1, f"{counters}")
        check(counters["resyncs"] == 0, f"{counters}")
        checks += 1
        print(f"   kv events e2e: check {checks} passed", flush=True)

        # The publisher restarts: seq from 0, an empty cache, the older array encoding
        # with integer hashes. Its seq must stay below the old one's until the node
        # hears it, or a restart whose close went unseen reads as a gap (the seq is then all
        # a subscriber has): the
        # old publisher's seq is raised well past the empty batches sent below.
        for _ in range(400):
            publisher.publish([])
        wait_until("the node to take the old batches",
                   lambda: state()["kv_events"]["counters"]["batches"] >= publisher.seq,
                   procs, publisher)
        restarts = state()["kv_events"]["counters"]["restarts"]
        pub_port, replay_port = publisher.pub_port, publisher.replay_port
        publisher.close()
        publisher = Publisher(ctx, pub_port, replay_port, old_encoding=True)
        engine = RefEngine(int_hashes=True)
        p4 = base + tokens(64)
        prompts.append(p4)
        publisher.publish([("stored", engine.store(p4))])

        def restarted_and_followed():
            if state()["kv_events"]["counters"]["restarts"] == restarts:
                check(publisher.seq < 300, "the node never heard the restarted publisher")
                publisher.publish([])
            return matches(engine, prompts)
        wait_until("the node to follow the restarted publisher", restarted_and_followed,
                   procs, publisher)
        # The old cache is gone but for the prefix p4 shares with p1.
        check((held(p1), held(p3), held(p4)) == (4, 0, 5),
              f"after restart: p1 {held(p1)}, p3 {held(p3)}, p4 {held(p4)}")
        checks += 1
        print(f"   kv events e2e: check {checks} passed", flush=True)

        # AllBlocksCleared empties the index.
        publisher.publish([("cleared", None)])
        engine.blocks.clear()
        wait_until("the clear", lambda: matches(engine, prompts) and held(p4) == 0, procs,
                   publisher)
        checks += 1
        print(f"   kv events e2e: check {checks} passed", flush=True)

        # The metrics say what happened.
        with urllib.request.urlopen(f"{admin}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        # The restart is seen when the publisher's connection closes (the node stops
        # trusting its picture then, docs/kv-events.md), before any seq could say it.
        for name in ["gorgo_kv_event_gaps_total 1", "gorgo_kv_event_disconnects_total 1",
                     "gorgo_kv_event_source_events 1", "gorgo_kv_event_replays_total"]:
            check(name in metrics, f"{name} not in /metrics")
        checks += 1
        print(f"   kv events e2e: check {checks} passed", flush=True)
        print(f"kv events e2e: {checks} passed, 0 failed")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        publisher.close()
        ctx.destroy(linger=0)
        logs.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        run(sys.argv[1])
    except Exception as e:  # noqa: BLE001 - report and fail
        print(f"kv events e2e FAILED: {e}", file=sys.stderr)
        sys.exit(1)
