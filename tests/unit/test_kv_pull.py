"""The decode engine's puller of prefilled KV blocks (worker/kv_pull.py) against
scripted prefill peers (ZMQ ROUTER sockets on loopback): a bounded number of
pulls at once, answers tied to the run they answer, and a puller that outlives
running out of sockets. Every job is reported exactly once."""

from __future__ import annotations

import errno
import socket
import threading
import time

import msgpack
import pytest
import torch
import zmq

from heron.core.kv_remote import RemoteLoad
from heron.worker import kv_pull
from heron.worker.kv_load_reports import LoadReports
from heron.worker.kv_pull import RemoteKVLoader

FINGERPRINT = b"layout"


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.term()


def pool() -> torch.Tensor:
    return torch.zeros(2, 8, 4, 1, 4)  # [K/V, blocks, block size, heads, head dim]: 128 bytes a block


def job(address: str, name: str, block_ids: list[int], first: int = 0) -> RemoteLoad:
    return RemoteLoad(name, address, f"remote-{name}", first, [(bytes([i]) * 32, i) for i in block_ids])


def wait_reports(reports: LoadReports, count: int, timeout: float = 10) -> list[tuple[str, list]]:
    taken: list[tuple[str, list]] = []
    deadline = time.monotonic() + timeout
    while len(taken) < count and time.monotonic() < deadline:
        reports.wait(0.1)
        taken += reports.take()
    return taken


class ScriptedPeer:
    """A prefill engine's block server that answers each pull with ``answer(message)`` (a list of frames each)."""

    def __init__(self, context: zmq.Context, answer) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.answer = answer
        self.pulls: list[list] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            if not self.socket.poll(20):
                continue
            identity, frame = self.socket.recv_multipart()
            message = msgpack.unpackb(frame)
            if message[0] != "pull":
                continue
            self.pulls.append(message)
            for frames in self.answer(message):
                self.socket.send_multipart([identity, *frames])

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(5)
        self.socket.close(0)


def blocks_of(value: int):
    """Answer every pull with blocks full of ``value``."""
    def answer(message: list) -> list[list[bytes]]:
        _, _, first, count, _ = message
        return [[msgpack.packb([True, FINGERPRINT, first, count]), *[bytes([value]) * 128] * count]]
    return answer


def test_pulls_beyond_the_cap_wait_their_turn_and_all_are_reported(context, monkeypatch):
    monkeypatch.setattr(kv_pull, "MAX_PULLS", 2)
    silent = ScriptedPeer(context, lambda message: [])
    reports = LoadReports()
    loader = RemoteKVLoader([pool()], FINGERPRINT, reports, timeout_s=0.5)
    try:
        loader.load([job(silent.address, f"r{i}", [i]) for i in range(5)])
        time.sleep(0.3)
        assert len(silent.pulls) == 2  # two under way, three waiting
        failed = wait_reports(reports, 5)
        assert sorted(name for name, hashes in failed if hashes) == [f"r{i}" for i in range(5)]
        assert len(silent.pulls) == 5
        good = ScriptedPeer(context, blocks_of(7))
        loader.load([job(good.address, "after", [6])])
        assert wait_reports(reports, 1) == [("after", [])]
        good.close()
    finally:
        loader.close()
        silent.close()


def test_an_answer_for_another_run_fails_the_pull(context):
    def twice(message: list) -> list[list[bytes]]:  # answers the first question twice, then the second
        return blocks_of(message[2] + 1)(message) * (2 if message[2] == 0 else 1)

    peer = ScriptedPeer(context, twice)
    reports = LoadReports()
    cache = pool()
    loader = RemoteKVLoader([cache], FINGERPRINT, reports, timeout_s=2, chunk_bytes=128)  # one block a pull
    try:
        loader.load([job(peer.address, "r", [1, 2])])
        (name, failed), = wait_reports(reports, 1)
        # the duplicate was not taken for block 2; block 1 came whole and is kept (not reported failed)
        assert name == "r" and len(failed) == 1
        assert torch.all(cache[:, 2] == 0)
    finally:
        loader.close()
        peer.close()


def test_a_chunked_pull_writes_every_block_and_releases_once(context):
    peer = ScriptedPeer(context, blocks_of(3))
    reports = LoadReports()
    cache = pool()
    loader = RemoteKVLoader([cache], FINGERPRINT, reports, timeout_s=2, chunk_bytes=256)  # two blocks a pull
    try:
        loader.load([job(peer.address, "r", [1, 2, 3, 4, 5], first=2)])
        assert wait_reports(reports, 1) == [("r", [])]
        assert [message[2:4] for message in peer.pulls] == [[2, 2], [4, 2], [6, 1]]
        assert torch.all(cache[:, 1:6].view(torch.int32) != 0) and torch.all(cache[:, 6:] == 0)
    finally:
        loader.close()
        peer.close()


class RefusingContext:
    """A ZMQ context whose next ``socket()`` calls fail: out of sockets, then anything else."""

    def __init__(self, context: zmq.Context) -> None:
        self.context = context
        # per job, its pull's socket then its release's (None: made as usual)
        self.refusals: list[Exception | None] = [zmq.ZMQError(errno.EMFILE), None, RuntimeError("unexpected"), None]

    def socket(self, kind: int) -> zmq.Socket:
        refusal = self.refusals.pop(0) if self.refusals else None
        if refusal is not None:
            raise refusal
        return self.context.socket(kind)

    def term(self) -> None:
        self.context.term()


def test_running_out_of_sockets_fails_that_pull_and_not_the_puller(context):
    peer = ScriptedPeer(context, blocks_of(5))
    reports = LoadReports()
    loader = RemoteKVLoader([pool()], FINGERPRINT, reports, timeout_s=2)
    loader._context = RefusingContext(loader._context)
    try:
        for name in ("out of sockets", "unexpected"):
            loader.load([job(peer.address, name, [1])])
            assert [(reported, bool(failed)) for reported, failed in wait_reports(reports, 1)] == [(name, True)]
        loader.load([job(peer.address, "next", [2])])
        assert wait_reports(reports, 1) == [("next", [])]
    finally:
        loader.close()
        peer.close()


def test_a_stalled_engine_holds_only_its_share_of_the_pulls(context, monkeypatch):
    """128 pulls to a silent prefill engine took every place, and a pull from a
    healthy one waited out their timeout (4.8 s of a 5 s timeout)."""
    monkeypatch.setattr(kv_pull, "MAX_PULLS", 4)
    monkeypatch.setattr(kv_pull, "MAX_PULLS_PER_PEER", 2)
    silent = ScriptedPeer(context, lambda message: [])
    good = ScriptedPeer(context, blocks_of(7))
    reports = LoadReports()
    loader = RemoteKVLoader([pool()], FINGERPRINT, reports, timeout_s=5)
    try:
        loader.load([job(silent.address, f"s{i}", [i]) for i in range(4)])
        time.sleep(0.2)
        assert len(silent.pulls) == 2  # its share under way, the rest in line
        started = time.monotonic()
        loader.load([job(good.address, "healthy", [7])])
        assert wait_reports(reports, 1, timeout=3) == [("healthy", [])]
        assert time.monotonic() - started < 2
        failed = wait_reports(reports, 4, timeout=30)  # the silent ones still end, each reported once
        assert sorted(name for name, hashes in failed if hashes) == [f"s{i}" for i in range(4)]
    finally:
        loader.close()
        silent.close()
        good.close()


def test_a_prefill_engine_that_is_gone_fails_its_pulls_at_once(context):
    """Nothing listening at its address (it died), or its connection closed
    while a pull waited: the pull waited out the whole timeout (30 s by
    default), holding every request that engine had prefilled, though its
    leases had died with it (found by the router review)."""
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        nowhere = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    closing = ScriptedPeer(context, lambda message: [])
    reports = LoadReports()
    loader = RemoteKVLoader([pool()], FINGERPRINT, reports, timeout_s=30)
    try:
        started = time.monotonic()
        loader.load([job(nowhere, "refused", [1])])
        assert wait_reports(reports, 1) == [("refused", [bytes([1]) * 32])]
        loader.load([job(closing.address, "closed", [2])])
        deadline = time.monotonic() + 5
        while not closing.pulls and time.monotonic() < deadline:
            time.sleep(0.01)
        closing.close()  # the engine dies with the pull under way
        assert wait_reports(reports, 1) == [("closed", [bytes([2]) * 32])]
        assert time.monotonic() - started < 10
    finally:
        loader.close()
