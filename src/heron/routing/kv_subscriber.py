"""Keeping a replica's ``KVBlockIndex`` up to date from its published events.

The subscriber reads the replica's PUB socket (``engine/kv_events_publisher.py``
describes the frames). When a batch's sequence number skips ahead of the last
one applied, the missing batches are fetched from the replica's replay socket
before the new one is applied. Batches that do not come (the replica no longer
keeps them, the replay gets no answer, or comes with a hole) are lost for good:
the index is then cleared and rebuilt from the batches after them (it may
under-count, never claim a block that was reported removed after what it saw).
A batch this router cannot decode (another version's events, hashes of a
kind an index cannot hold) costs the same, and a message of the wrong shape is
skipped: neither ends the subscription.
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
        self, context: zmq.asyncio.Context, endpoint: str, replay_endpoint: str, topic: str, index: KVBlockIndex,
        epoch: str | None = None,
    ) -> None:
        """``epoch``: the publisher's (``GET /v1/kv_events``), to tell when it restarted."""
        self.context = context
        self.epoch = epoch
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
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    self._skip(frames)
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.index.last_seq + 1 and not await self.replay(self.index.last_seq + 1):
                    self._lose(self.index.last_seq + 1, seq)  # what the replay did not bring is lost
                self._apply(seq, payload)
        finally:
            socket.close(0)

    async def replay(self, start: int) -> bool:
        """Apply every batch from ``start`` the replica still keeps; False when the
        replay did not come whole (no answer in time: the caller decides)."""
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.replay_endpoint)
        self.num_replays += 1
        try:
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            expected = start
            while await socket.poll(REPLAY_TIMEOUT_MS):
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    self._skip(frames)
                    continue
                _, seq_bytes, payload = frames
                if seq_bytes == END_OF_REPLAY:
                    return True
                seq = int.from_bytes(seq_bytes, "big")
                if seq > expected and self.index.last_seq >= 0:
                    self._lose(expected, seq)  # gone from the replica's buffer, or dropped on the way
                self._apply(seq, payload)
                expected = max(expected, seq + 1)
            logger.warning("no replay from %s within %d ms", self.replay_endpoint, REPLAY_TIMEOUT_MS)
            return False
        finally:
            socket.close(0)

    def _skip(self, frames: list[bytes]) -> None:
        """A message not in the publisher's form (topic, sequence number,
        batch): no batch to place, so it is passed over; a batch it hid shows
        as a gap in the numbering, which is replayed."""
        logger.warning("a KV event message of %d frames from %s (3 expected): skipped", len(frames), self.endpoint)

    def _lose(self, first: int, seq: int) -> None:
        """Batches ``first .. seq - 1`` will never be seen: the index cannot be
        trusted any more, so it starts again from ``seq``."""
        if seq <= self.index.last_seq + 1:
            return
        self.num_lost_batches += seq - first
        logger.warning("KV events %d..%d from %s are lost: rebuilding its index", first, seq - 1, self.endpoint)
        self.index.reset(last_seq=seq - 1)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except Exception as error:  # noqa: BLE001 (another version's events: never the end of the subscription)
            logger.warning("undecodable KV event batch %d from %s (%s): rebuilding its index", seq, self.endpoint,
                           error)
            self.num_lost_batches += 1
            self.index.reset(last_seq=seq)
            return
        self.index.apply(seq, batch)
