"""Publishing KV-cache events (``core/kv_events.py``) over ZMQ, as vLLM does.

Every engine step's events go out as one message on a PUB socket: three frames,
``[topic, sequence number (8 bytes, big-endian), msgpack batch]``; sequence
numbers start at 0 and grow by one per batch, so a subscriber sees a gap when
it missed one; each publisher has a random ``epoch`` (in ``GET /v1/kv_events``
and ``/health``), so a subscriber tells a restarted engine's numbers from old
ones. The last ``buffer_steps`` batches are kept: a ROUTER socket at the replay
endpoint answers a request frame holding a start sequence number (8
bytes, big-endian) with ``[seq, batch]`` for every kept batch from there on,
then ``[-1 (8 bytes, signed), b""]``. A subscriber subscribes first, replays
from the last number it saw + 1, and drops live batches it already has.

Nothing grows without bound: the PUB socket queues at most ``hwm`` batches for
a subscriber that does not read; the replay socket two whole replays for a peer
that does not read its answers (each request queued a copy of the whole buffer,
so a peer asking again and again grew the engine process by the buffer's size
each time); the steps' queue ``max_queue_size`` batches, past which a batch is
dropped and its number skipped, so subscribers see a gap and rebuild.

One thread owns both sockets (ZMQ sockets are not thread-safe); the engine
step only puts the encoded batch on a queue.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque

import zmq

from heron.config import KVEventsConfig
from heron.core.kv_events import END_OF_REPLAY, KVCacheEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

_POLL_MS = 20


class ZmqEventPublisher:
    """Binds ``config.endpoint`` (PUB) and the replay endpoint (ROUTER);
    ``endpoint`` / ``replay_endpoint`` are the bound addresses (a ``*`` port
    resolved to the port the system chose)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.topic = config.topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, min(config.hwm, 2**31 - 1))
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        # a whole replay (the buffer and its end) is queued whole; past two, a peer's answers are dropped
        self._replay.setsockopt(zmq.SNDHWM, min(2 * (config.buffer_steps + 1), 2**31 - 1))  # (a C int)
        # this publisher's numbering: a restarted engine numbers from 0 again under another epoch
        self.epoch = secrets.token_hex(8)
        replay_address = config.replay_endpoint or _any_port(config.endpoint)
        binding = config.endpoint
        try:
            self.endpoint = _bind(self._pub, binding)
            binding = replay_address
            self.replay_endpoint = _bind(self._replay, binding)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot bind {binding!r}: {exc}") from exc
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        # the steps' batches for the thread, in order: an int is a run of batches dropped when it was full
        # (their numbers are skipped there), None the end
        self._pending: deque[bytes | int | None] = deque()
        self._pending_lock = threading.Lock()
        self._max_pending = config.max_queue_size
        self._warned_full = False
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="heron-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (nothing when there are none, or once the
        publishing thread has stopped: they would pile up unsent)."""
        if events and self._thread.is_alive():
            self._enqueue(encode_batch(KVEventBatch(time.time(), events, self.data_parallel_rank)))

    def _enqueue(self, payload: bytes) -> None:
        """An encoded batch for the thread to number and send."""
        with self._pending_lock:  # the engine step never waits on the publisher: past the bound, a gap
            if len(self._pending) < self._max_pending:
                self._pending.append(payload)
                return
            last = self._pending[-1]
            if isinstance(last, int):
                self._pending[-1] = last + 1
            else:
                self._pending.append(1)
        if not self._warned_full:
            self._warned_full = True
            logger.warning("KV event queue full (max_queue_size %d): dropping batches; subscribers see the gap "
                           "and rebuild their index", self._max_pending)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            with self._pending_lock:
                self._pending.append(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                if not self._send_queued():
                    return
                if dict(poller.poll(_POLL_MS)).get(self._replay):
                    if not self._send_queued():  # a replay covers every batch published before it
                        return
                    self._answer_replay()
        except zmq.ZMQError as exc:  # the context was torn down under us
            logger.warning("KV event publisher stopped: %s", exc)
        finally:
            self._close_sockets()

    def _send_queued(self) -> bool:
        """Send every queued batch; False once shutdown was asked for."""
        while True:
            with self._pending_lock:
                if not self._pending:
                    return True
                payload = self._pending.popleft()
            if payload is None:
                return False
            if isinstance(payload, int):  # dropped batches keep their numbers: a gap subscribers see
                self._next_seq += payload
                continue
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, request = frames[0], frames[-1]
        start = int.from_bytes(request, "big") if len(request) == 8 else 0
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        self._pub.close(0)
        self._replay.close(0)
        self._context.term()


def _bind(socket: zmq.Socket, address: str) -> str:
    """Bind, returning the bound address (ZMQ resolves a ``*`` port)."""
    if address.startswith("tcp://") and address.rsplit(":", 1)[-1] in ("*", "0"):
        socket.bind(address.rsplit(":", 1)[0] + ":*")
    else:
        socket.bind(address)
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


def _any_port(endpoint: str) -> str:
    """A free port on the endpoint's host (ipc: a sibling path)."""
    if endpoint.startswith("tcp://"):
        return endpoint.rsplit(":", 1)[0] + ":*"
    return endpoint + "-replay"


def connectable(address: str, host: str) -> str:
    """A bound address as another machine dials it: ``tcp://0.0.0.0:5557`` (a
    wildcard bind) becomes ``tcp://HOST:5557``."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if address.startswith(wildcard):
            return f"tcp://{host}:" + address[len(wildcard):]
    return address
