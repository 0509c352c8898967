"""Keeping a replica's ``KVBlockIndex`` up to date from its published events.

The subscriber reads the replica's PUB socket (``engine/kv_events_publisher.py``
describes the frames). When a batch's sequence number skips ahead of the last
one applied, the missing batches are fetched from the replica's replay socket
before the new one is applied; batches the replica no longer keeps are lost for
good, and the index is rebuilt from what remains (it may under-count, never
claim a block that was reported removed after what it saw).
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from heron.core.kv_events import END_OF_REPLAY, decode_batch
from heron.routing.kv_index import KVBlockIndex

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_MS = 2000


class KVEventSubscriber:
    def __init__(
        self, context: zmq.asyncio.Context, endpoint: str, replay_endpoint: str, topic: str, index: KVBlockIndex
    ) -> None:
        self.context = context
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.num_replays = 0
        self.num_lost_batches = 0

    async def run(self) -> None:
        """Apply batches until cancelled. On joining, everything the replica still
        keeps is replayed first, so a router started late knows the cache too."""
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, self.topic)
        socket.connect(self.endpoint)
        try:
            await self.replay(0)
            while True:
                _, seq_bytes, payload = await socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.index.last_seq + 1:
                    await self.replay(self.index.last_seq + 1)
                self.index.apply(seq, decode_batch(payload))
        finally:
            socket.close(0)

    async def replay(self, start: int) -> None:
        """Apply every batch from ``start`` the replica still keeps."""
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.replay_endpoint)
        self.num_replays += 1
        try:
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            first = True
            while await socket.poll(REPLAY_TIMEOUT_MS):
                _, seq_bytes, payload = await socket.recv_multipart()
                if seq_bytes == END_OF_REPLAY:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if first and seq > start and self.index.last_seq >= 0:
                    self.num_lost_batches += seq - start
                    logger.warning("KV events %d..%d are gone from %s: rebuilding its index", start, seq - 1,
                                   self.endpoint)
                    self.index.reset(last_seq=seq - 1)
                first = False
                self.index.apply(seq, decode_batch(payload))
            logger.warning("no replay from %s within %d ms", self.replay_endpoint, REPLAY_TIMEOUT_MS)
        finally:
            socket.close(0)
