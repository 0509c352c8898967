"""Prefill/decode disaggregation, the worker's half: a prefill engine serves
the blocks of its finished ``do_remote_decode`` requests (``KVBlockServer``,
here), a decode engine pulls them into its own pool (``RemoteKVLoader``,
``worker/kv_pull.py``), over TCP with ZMQ.

    decode -> prefill   msgpack ["pull", request id, first block, count, the count blocks' hashes]
    prefill -> decode   frames [msgpack [True, layout fingerprint, first, count], block 0, ..., block count - 1]
                        or [msgpack [False, reason]]
    decode -> prefill   msgpack ["release", request id(, first block, the hashes it pulled)]

A decode engine pulls a long prompt in several pulls of a bounded size (each
a run of the offered blocks), so no message grows with the prompt; blocks go
out as frames of their own, never copied into one large message.

The prefill engine's scheduler holds a finished request's blocks under a
lease (``offer``) until the decode engine releases them or the lease expires
(``withdraw``). Blocks are copied out of the pool without holding the lock the
engine's step loop takes (offers and releases never wait for a copy); a
withdraw waits for a copy of that request's blocks under way, so blocks are
never read while being reused. A pull names the hashes of the blocks it
wants (its own prompt's chained hashes, cache salt included): blocks of
another prompt are refused, so a stale or foreign handle never fills a prefix
cache with the wrong KV.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import msgpack
import torch
import zmq

from heron.worker.kv_block_codec import BlockCodec

logger = logging.getLogger(__name__)

_POLL_MS = 100
MAX_REPLY_BYTES = 256 << 20  # one pull's blocks at most (decode engines ask for 32 MiB: kv_pull.CHUNK_BYTES)


class KVBlockServer:
    def __init__(self, caches: Sequence[torch.Tensor], fingerprint: bytes, host: str, port: int) -> None:
        self.codec = BlockCodec(caches)
        self.fingerprint = fingerprint
        self._lock = threading.Condition()
        self._offers: dict[str, tuple[list[int], list[bytes]]] = {}  # request id -> block ids, their hashes
        self._reading: str | None = None  # the request whose blocks are being copied (one serving thread)
        self._released: list[str] = []
        self._release_event = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:  # a host not of this machine, a port taken: ZMQ's traceback named neither
            self._socket.close(0)
            self._context.term()
            raise ValueError(f"kv_transfer_config: cannot serve blocks on {host}:{port or '*'} ({exc}); "
                             "kv_ip must be an address of this machine and kv_port free") from exc
        self.host = host
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-block-server", daemon=True)
        self._thread.start()

    def offer(self, request_id: str, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Serve these blocks (leased by the scheduler) until released or withdrawn."""
        with self._lock:
            self._offers[request_id] = (block_ids, block_hashes)

    def withdraw(self, request_id: str) -> None:
        """Stop serving a request's blocks (its lease expired); no pull reads them after this returns."""
        with self._lock:
            self._offers.pop(request_id, None)
            self._lock.wait_for(lambda: self._reading != request_id)

    def take_released(self) -> list[str]:
        """Requests whose blocks a decode engine has taken since the last call."""
        with self._lock:
            released, self._released = self._released, []
            self._release_event.clear()
        return released

    def wait_for_release(self, timeout: float) -> None:
        self._release_event.wait(timeout)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._socket.close(0)
        self._context.term()

    def _serve(self) -> None:
        with torch.inference_mode():
            while not self._stopped.is_set():
                if not self._socket.poll(_POLL_MS):
                    continue
                frames = self._socket.recv_multipart()
                if len(frames) != 2:
                    continue  # not a peer's message (a DEALER sends one frame): ignored, never fatal
                identity, frame = frames
                try:
                    reply = self._handle(msgpack.unpackb(frame))
                except Exception as error:  # a malformed message: answered, never fatal
                    reply = [msgpack.packb([False, f"bad message: {type(error).__name__}: {error}"])]
                if reply is not None:
                    try:
                        self._socket.send_multipart([identity, *reply], copy=False)
                    except zmq.ZMQError as error:
                        logger.warning("could not answer a KV pull: %s", error)

    def _handle(self, message: list) -> list | None:
        """The reply's frames (None: no reply)."""
        kind, request_id = message[0], str(message[1])
        if kind == "release":
            self._release(request_id, message)
            return None
        if kind != "pull":
            return [msgpack.packb([False, f"unknown message {kind!r}"])]
        first, count = int(message[2]), int(message[3])
        wanted = [bytes(h) for h in message[4]] if len(message) > 4 else None
        with self._lock:
            offered = self._offers.get(request_id)
            if offered is None:
                return [msgpack.packb([False, f"no blocks offered for {request_id!r} (unknown, released or expired)"])]
            block_ids, block_hashes = offered
            if first < 0 or count < 0 or first + count > len(block_ids):
                return [msgpack.packb([False, f"{request_id!r} offers {len(block_ids)} blocks, "
                                              f"not [{first}, {first + count})"])]
            if count > max(1, MAX_REPLY_BYTES // self.codec.block_bytes):
                return [msgpack.packb([False, f"{count} blocks in one pull: ask for at most "
                                              f"{MAX_REPLY_BYTES >> 20} MiB at a time"])]
            if wanted != block_hashes[first:first + count]:
                return [msgpack.packb([False, f"{request_id!r} holds another prompt's blocks (their hashes differ)"])]
            self._reading = request_id  # a withdraw waits until the copy is done
        try:
            blocks = [row.numpy() for row in self.codec.capture(block_ids[first:first + count])]
        finally:
            with self._lock:
                self._reading = None
                self._lock.notify_all()
        return [msgpack.packb([True, self.fingerprint, first, count]), *blocks]

    def _release(self, request_id: str, message: list) -> None:
        """With the hashes it pulled, if any: only a pull of these blocks releases them."""
        first, named = (int(message[2]), [bytes(h) for h in message[3]]) if len(message) > 3 else (0, None)
        with self._lock:
            offered = self._offers.get(request_id)
            if offered is not None and named is not None and offered[1][first:first + len(named)] != named:
                return
            if self._offers.pop(request_id, None) is not None:
                self._released.append(request_id)
                self._release_event.set()
