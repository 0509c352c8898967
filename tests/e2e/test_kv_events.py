"""A live `heron serve` publishes its KV-cache events where `/v1/kv_events` says,
and a subscriber that hashes a prompt itself finds exactly those blocks stored."""

from __future__ import annotations

import json

import httpx
import zmq

from heron.core.hashing import BLOCK_HASH_SCHEME, hash_block_tokens
from heron.core.kv_events import BlockStored, decode_batch
from tests.e2e.server_process import ServerProcess

KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})


def test_a_served_prompt_is_published_as_blocks_a_router_can_hash_itself():
    server = ServerProcess("--kv-events-config", KV_EVENTS)
    context = zmq.Context()
    try:
        info = httpx.get(f"{server.base_url}/v1/kv_events").json()
        assert info["enabled"] and info["hash"] == BLOCK_HASH_SCHEME and info["block_size"] == 16
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, info["topic"].encode())
        subscriber.connect(info["endpoint"])
        for attempt in range(20):  # a subscription takes a moment to start (ZMQ's slow joiner)
            prompt = f"{attempt}: the heron stood in the shallow water at dawn, waiting. " * 4
            token_ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}).json()["tokens"]
            expected: list[bytes] = []
            for start in range(0, len(token_ids) - 15, 16):
                expected.append(hash_block_tokens(expected[-1] if expected else None, token_ids[start : start + 16]))
            response = httpx.post(f"{server.base_url}/v1/completions",
                                  json={"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=60)
            assert response.status_code == 200
            stored: list[bytes] = []
            while subscriber.poll(500):
                _, _, payload = subscriber.recv_multipart()
                for event in decode_batch(payload).events:
                    if isinstance(event, BlockStored):
                        stored += event.block_hashes
            if stored:
                break
        assert len(expected) >= 3 and stored == expected
    finally:
        context.destroy(0)
        server.stop()
