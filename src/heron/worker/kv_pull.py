"""Prefill/decode disaggregation, the decode engine's half: pull a finished
prefill's blocks from the prefill engine that holds them into this engine's
pool (the protocol is in ``worker/kv_transfer.py``).

One thread runs every pull at once, each on its own ZMQ socket, so a prefill
engine that is slow, stalled or gone delays only the requests whose blocks it
holds, never the pulls from other engines (up to ``MAX_PULLS`` run at once,
``MAX_PULLS_PER_PEER`` of them from one prefill engine; the rest wait their
turn, and a job whose engine is at its share lets later jobs for other engines
start first). A pull asks for at most
``chunk_bytes`` of blocks at a time (the next run once the last one is
written), and gives up when a prefill engine does not answer one run within
the timeout, or at once when its connection is refused or closed (a socket
monitor says so: a dead prefill engine held every request it had prefilled
for the whole timeout, 30 s by default, though its leases died with it).
Every job is reported exactly once (``LoadReports``): its blocks
loaded, or all of them failed, whatever a peer answers, so no request waits
for ever; the scheduler's load-failure policy decides what a failure costs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from heron.core.kv_remote import RemoteLoad
from heron.worker.kv_block_codec import BlockCodec
from heron.worker.kv_load_reports import LoadReports

logger = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # one pull's blocks at most (at least one block)
MAX_PULLS = 128  # under way at once, each on its own socket; the rest wait their turn
# under way at once from one prefill engine: one that stalls holds no more places than this (it held all of
# them, and a pull from a healthy engine waited out the stalled ones' timeout)
MAX_PULLS_PER_PEER = 32
# a pull's connection events that end it at once: nothing listens there (refused, retried), or the peer closed it
_GONE: dict[int, str] = {zmq.EVENT_CONNECT_RETRIED: "its connection was refused (is it running?)",
         zmq.EVENT_DISCONNECTED: "it closed the connection"}


@dataclass(slots=True)
class _Pull:
    """A job in flight: ``done`` of its blocks written, the next ``asked`` asked for by ``deadline``."""

    job: RemoteLoad
    socket: zmq.Socket
    monitor: zmq.Socket  # the socket's connection events (``_GONE``)
    done: int = 0
    asked: int = 0
    deadline: float = 0.0


class RemoteKVLoader:
    def __init__(self, caches: Sequence[torch.Tensor], fingerprint: bytes, reports: LoadReports,
                 timeout_s: float, chunk_bytes: int | None = None) -> None:
        self.codec = BlockCodec(caches)
        self.fingerprint = fingerprint
        self.reports = reports
        self.timeout_s = timeout_s
        self.chunk_blocks = max(1, (chunk_bytes or CHUNK_BYTES) // self.codec.block_bytes)
        self._context = zmq.Context()
        self._jobs: queue.SimpleQueue[RemoteLoad | None] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._thread = threading.Thread(target=self._run, name="kv-remote-loader", daemon=True)
        self._thread.start()

    def load(self, loads: list[RemoteLoad]) -> None:
        """Pull each load's blocks (one with none only releases the prefill engine's lease)."""
        self.reports.started(sum(1 for job in loads if job.blocks))
        for job in loads:
            self._jobs.put(job)
        self._wake()

    def close(self) -> None:
        """Stop; pulls still under way or waiting are reported failed."""
        self._jobs.put(None)
        self._wake()
        self._thread.join(timeout=5)
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._context.term()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is pending already

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        pulls: dict[zmq.Socket, _Pull] = {}
        waiting: deque[RemoteLoad] = deque()  # beyond MAX_PULLS under way
        stopping = False
        with torch.inference_mode():
            while not stopping:
                try:
                    ready = dict(poller.poll(_wait_ms(pulls.values())))
                    if self._wake_read in ready:
                        stopping = self._take_jobs(waiting)
                    self._advance(poller, pulls, ready)
                    self._start_waiting(poller, pulls, waiting)
                except Exception:  # a bug here must not leave requests waiting for ever
                    logger.exception("the KV puller failed: failing the pulls under way")
                    self._fail_all(poller, pulls, waiting, "the puller failed")
            self._fail_all(poller, pulls, waiting, "the engine is shutting down")

    def _start_waiting(self, poller: zmq.Poller, pulls: dict[zmq.Socket, _Pull], waiting: deque[RemoteLoad]) -> None:
        """Start waiting jobs in order, within ``MAX_PULLS`` and each engine's
        ``MAX_PULLS_PER_PEER`` (a job over its engine's share stays in line)."""
        if not waiting or len(pulls) >= MAX_PULLS:
            return
        per_peer: dict[str, int] = {}
        for pull in pulls.values():
            per_peer[pull.job.address] = per_peer.get(pull.job.address, 0) + 1
        held: deque[RemoteLoad] = deque()
        try:
            while waiting and len(pulls) < MAX_PULLS:
                job = waiting[0]
                if per_peer.get(job.address, 0) >= MAX_PULLS_PER_PEER:
                    held.append(waiting.popleft())
                    continue
                self._start(poller, pulls, job)
                waiting.popleft()  # after: a job _start failed on is still reported by _fail_all
                per_peer[job.address] = per_peer.get(job.address, 0) + 1
        finally:
            waiting.extendleft(reversed(held))  # back at the head, in their order (and reported if all fail)

    def _take_jobs(self, waiting: deque[RemoteLoad]) -> bool:
        """Queue the new jobs (releases go out at once); True once told to stop."""
        try:
            os.read(self._wake_read, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return False
            if job is None:
                return True
            if job.blocks:
                waiting.append(job)
            else:
                self._release(job)

    def _advance(self, poller: zmq.Poller, pulls: dict[zmq.Socket, _Pull], ready: dict) -> None:
        """Take the answers that came, ask for the next runs, end pulls done, failed or timed out."""
        now = time.monotonic()
        for socket, pull in list(pulls.items()):
            if socket in ready:
                error = self._receive(pull)  # whatever a peer sent fails this job only
            elif pull.monitor in ready and (gone := _gone(pull.monitor)) is not None:
                error = f"the prefill engine is gone: {gone}"
            elif now >= pull.deadline:
                error = f"no answer in {self.timeout_s:g} s"
            else:
                continue
            if error is None and pull.done < len(pull.job.blocks):
                error = self._ask(pull)
                if error is None:
                    continue
            _unregister(poller, pull)
            del pulls[socket]
            self._finish(pull, error)

    def _connect(self, address: str) -> zmq.Socket:
        """A socket to a prefill engine's block server (ZMQError: out of sockets, a bad address)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)  # a last release still goes out after close()
        try:
            socket.connect(address)
        except zmq.ZMQError:
            socket.close(0)
            raise
        return socket

    def _start(self, poller: zmq.Poller, pulls: dict[zmq.Socket, _Pull], job: RemoteLoad) -> None:
        try:
            socket = self._connect(job.address)
        except zmq.ZMQError as error:  # out of sockets, a bad address: this job fails, the next may not
            self._report(job, f"cannot connect: {error}")
            return
        pull = _Pull(job, socket, socket.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED))
        refused = self._ask(pull)
        if refused is not None:
            self._finish(pull, refused)
            return
        poller.register(socket, zmq.POLLIN)
        poller.register(pull.monitor, zmq.POLLIN)
        pulls[socket] = pull

    def _fail_all(self, poller: zmq.Poller, pulls: dict[zmq.Socket, _Pull], waiting: deque[RemoteLoad],
                  reason: str) -> None:
        for pull in pulls.values():
            _unregister(poller, pull)
            self._finish(pull, reason)
        pulls.clear()
        while waiting:
            self._report(waiting.popleft(), reason)

    def _ask(self, pull: _Pull) -> str | None:
        """Ask for the next run of blocks; the reason it cannot, or None."""
        job = pull.job
        pull.asked = min(self.chunk_blocks, len(job.blocks) - pull.done)
        hashes = job.block_hashes[pull.done:pull.done + pull.asked]
        pull.deadline = time.monotonic() + self.timeout_s
        try:
            pull.socket.send(msgpack.packb(["pull", job.remote_request_id, job.first + pull.done, pull.asked, hashes]),
                             zmq.NOBLOCK)
        except zmq.ZMQError as error:
            return f"could not ask: {error}"
        return None

    def _receive(self, pull: _Pull) -> str | None:
        """Write the run of blocks the peer answered; the reason it failed, or None."""
        try:
            frames = pull.socket.recv_multipart(copy=False)
            header = msgpack.unpackb(frames[0].buffer)
            if not isinstance(header, list) or not header:
                return "a malformed answer"
            if not header[0]:
                return str(header[1]) if len(header) > 1 else "refused"
            if len(header) < 4 or header[1] != self.fingerprint:
                return ("the prefill engine runs another model or cache layout (with speculative decoding, both "
                        "engines need the same draft model: its caches travel with the blocks)")
            if header[2:4] != [pull.job.first + pull.done, pull.asked]:
                return f"blocks {header[2:4]} answered, not [{pull.job.first + pull.done}, {pull.asked}]"
            blocks = frames[1:]
            if len(blocks) != pull.asked or any(len(block) != self.codec.block_bytes for block in blocks):
                return f"{len(blocks)} blocks of {[len(b) for b in blocks[:3]]} bytes, not {pull.asked}"
            rows = torch.stack([torch.frombuffer(block.buffer, dtype=torch.uint8) for block in blocks])
            answered = pull.job.blocks[pull.done:pull.done + pull.asked]
            self.codec.restore(rows, [block_id for _, block_id in answered])
            pull.done += pull.asked
            return None
        except Exception as error:  # noqa: BLE001 (a peer's answer can be anything)
            return f"{type(error).__name__}: {error}"

    def _finish(self, pull: _Pull, error: str | None) -> None:
        """Report the job (loaded, or every block failed) and release the prefill engine's lease."""
        with contextlib.suppress(zmq.ZMQError):
            pull.socket.disable_monitor()
        pull.monitor.close(0)
        if error is None:
            _send_release(pull.socket, pull.job)
            pull.socket.close()  # lingers until the release is out
            self.reports.finished(pull.job.request_id, [])
        else:
            pull.socket.close(0)  # drops a question still queued for a peer that never came
            self._report(pull.job, error, pull.done)

    def _report(self, job: RemoteLoad, error: str, num_done: int = 0) -> None:
        """The job's blocks from ``num_done`` on failed (those before came whole and are kept: a
        pull cut in its last run recomputed the whole prompt): reported first, then the lease
        released (best effort)."""
        failed = job.block_hashes[num_done:]
        logger.warning("%s: could not pull %d of %d blocks from %s: %s", job.request_id, len(failed), len(job.blocks),
                       job.address, error)
        self.reports.finished(job.request_id, failed, f"the prefill engine at {job.address}: {error}")
        self._release(job)

    def _release(self, job: RemoteLoad) -> None:
        """Tell the prefill engine its blocks are not needed (best effort: its lease expires anyway)."""
        try:  # never raises: it runs after the job was reported
            socket = self._connect(job.address)
        except Exception as error:  # noqa: BLE001
            logger.info("could not release %s at %s: %s", job.remote_request_id, job.address, error)
            return
        _send_release(socket, job)
        socket.close()


def _unregister(poller: zmq.Poller, pull: _Pull) -> None:
    for socket in (pull.socket, pull.monitor):
        with contextlib.suppress(KeyError):
            poller.unregister(socket)


def _gone(monitor: zmq.Socket) -> str | None:
    """Why the monitored connection is gone (``_GONE``), from the events waiting on ``monitor``; None if not."""
    reason = None
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return reason
        reason = reason or _GONE.get(event["event"])


def _wait_ms(pulls: Iterable[_Pull]) -> int | None:
    """Until the nearest pull's deadline (None: no pull under way, wait for a job)."""
    deadlines = [pull.deadline for pull in pulls]
    if not deadlines:
        return None
    return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)


def _send_release(socket: zmq.Socket, job: RemoteLoad) -> None:
    message = ["release", job.remote_request_id] if not job.blocks else \
        ["release", job.remote_request_id, job.first, job.block_hashes]
    try:
        socket.send(msgpack.packb(message), zmq.NOBLOCK)
    except zmq.ZMQError as error:
        logger.info("could not release %s at %s: %s", job.remote_request_id, job.address, error)
