"""Prefill/decode disaggregation, the worker's half: a prefill engine serves
the blocks of its finished ``do_remote_decode`` requests (``KVBlockServer``),
a decode engine pulls them into its own pool (``RemoteKVLoader``), over TCP
with ZMQ (msgpack frames).

    decode -> prefill   ["pull", request id, first block, count, the count blocks' hashes]
    prefill -> decode   [True, layout fingerprint, count x block bytes] | [False, reason]
    decode -> prefill   ["release", request id(, first block, the hashes it pulled)]

The prefill engine's scheduler holds a finished request's blocks under a
lease (``offer``) until the decode engine releases them or the lease expires
(``withdraw``); a pull and a withdraw exclude each other, so blocks are never
read while being reused. A pull names the hashes of the blocks it wants (its
own prompt's chained hashes, cache salt included): blocks of another prompt
are refused, so a stale or foreign handle never fills a prefix cache with the
wrong KV. The decode engine checks the fingerprint (the same
model and cache layout, ``core/kv_disk_layout.py``) and reports every block
failed when the pull fails or times out: the scheduler's load-failure policy
decides what happens then (recompute, or fail the request).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import msgpack
import torch
import zmq

from heron.core.kv_remote import RemoteLoad
from heron.worker.kv_block_codec import BlockCodec
from heron.worker.kv_load_reports import LoadReports

logger = logging.getLogger(__name__)

_POLL_MS = 100


class KVBlockServer:
    def __init__(self, caches: Sequence[torch.Tensor], fingerprint: bytes, host: str, port: int) -> None:
        self.codec = BlockCodec(caches)
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self._offers: dict[str, tuple[list[int], list[bytes]]] = {}  # request id -> block ids, their hashes
        self._released: list[str] = []
        self._release_event = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}")
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
                    packed = msgpack.packb(reply) if reply is not None else None
                except Exception as error:  # a malformed message, a reply too large: answered, never fatal
                    packed = msgpack.packb([False, f"bad message: {type(error).__name__}: {error}"])
                if packed is not None:
                    try:
                        self._socket.send_multipart([identity, packed])
                    except zmq.ZMQError as error:
                        logger.warning("could not answer a KV pull: %s", error)

    def _handle(self, message: list) -> list | None:
        kind, request_id = message[0], str(message[1])
        if kind == "release":  # with the hashes it pulled, if any: only a pull of these blocks releases them
            first, named = (int(message[2]), [bytes(h) for h in message[3]]) if len(message) > 3 else (0, None)
            with self._lock:
                offered = self._offers.get(request_id)
                if offered is not None and named is not None and offered[1][first:first + len(named)] != named:
                    return None
                if self._offers.pop(request_id, None) is not None:
                    self._released.append(request_id)
                    self._release_event.set()
            return None
        if kind != "pull":
            return [False, f"unknown message {kind!r}"]
        first, count = int(message[2]), int(message[3])
        wanted = [bytes(h) for h in message[4]] if len(message) > 4 else None
        with self._lock:
            offered = self._offers.get(request_id)
            if offered is None:
                return [False, f"no blocks offered for {request_id!r} (unknown, released or expired)"]
            block_ids, block_hashes = offered
            if first < 0 or count < 0 or first + count > len(block_ids):
                return [False, f"{request_id!r} offers {len(block_ids)} blocks, not [{first}, {first + count})"]
            if wanted != block_hashes[first:first + count]:
                return [False, f"{request_id!r} holds another prompt's blocks (their hashes differ)"]
            payload = b"".join(self.codec.capture(block_id).numpy().tobytes()
                               for block_id in block_ids[first:first + count])
        return [True, self.fingerprint, payload]


class RemoteKVLoader:
    def __init__(self, caches: Sequence[torch.Tensor], fingerprint: bytes, reports: LoadReports,
                 timeout_s: float) -> None:
        self.codec = BlockCodec(caches)
        self.fingerprint = fingerprint
        self.reports = reports
        self.timeout_ms = int(timeout_s * 1000)
        self._context = zmq.Context()
        self._jobs: queue.Queue[RemoteLoad | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-remote-loader", daemon=True)
        self._thread.start()

    def load(self, loads: list[RemoteLoad]) -> None:
        """Pull each load's blocks (one with none only releases the prefill engine's lease)."""
        self.reports.started(sum(1 for job in loads if job.blocks))
        for job in loads:
            self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._context.term()

    def _run(self) -> None:
        with torch.inference_mode():
            while (job := self._jobs.get()) is not None:
                if not job.blocks:
                    self._release(job)
                    continue
                error = self._pull(job)  # whatever a peer sent fails this job only
                if error is not None:
                    logger.warning("%s: could not pull %d blocks from %s: %s",
                                   job.request_id, len(job.blocks), job.address, error)
                    self._release(job)
                # every job is reported, so no request waits for ever
                self.reports.finished(job.request_id, [] if error is None else job.block_hashes)

    def _release(self, job: RemoteLoad) -> None:
        """Tell the prefill engine its blocks are not needed (best effort: its lease expires anyway)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)
        try:
            socket.connect(job.address)
            socket.send(msgpack.packb(_release_message(job)))
        except Exception as error:  # noqa: BLE001 (best effort)
            logger.info("could not release %s at %s: %s", job.remote_request_id, job.address, error)
        finally:
            socket.close()

    def _pull(self, job: RemoteLoad) -> str | None:
        """Pull and write the blocks; the reason it failed, or None (whatever the peer answers)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)
        try:
            socket.connect(job.address)
            socket.send(msgpack.packb(["pull", job.remote_request_id, job.first, len(job.blocks), job.block_hashes]))
            if not socket.poll(self.timeout_ms):
                return f"no answer in {self.timeout_ms / 1000:.0f} s"
            reply = msgpack.unpackb(socket.recv())
            if not isinstance(reply, list) or not reply:
                return "a malformed answer"
            if not reply[0]:
                return str(reply[1])
            fingerprint, payload = reply[1], reply[2]
            if fingerprint != self.fingerprint:
                return "the prefill engine runs another model or cache layout"
            if len(payload) != len(job.blocks) * self.codec.block_bytes:
                return f"{len(payload)} bytes for {len(job.blocks)} blocks"
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            size = self.codec.block_bytes
            for index, (_, block_id) in enumerate(job.blocks):
                self.codec.restore(data[index * size:(index + 1) * size], block_id)
            socket.send(msgpack.packb(_release_message(job)))
            return None
        except Exception as error:  # noqa: BLE001 (a peer's answer can be anything)
            return f"{type(error).__name__}: {error}"
        finally:
            socket.close()


def _release_message(job: RemoteLoad) -> list:
    if not job.blocks:
        return ["release", job.remote_request_id]
    return ["release", job.remote_request_id, job.first, job.block_hashes]
