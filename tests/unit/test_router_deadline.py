"""``heron router --request-timeout``: no limit unless asked; past the limit the
client gets 504 (before the answer's head) or an error event ending its stream,
the request is not run again on another replica, and no breaker counts it
(a long generation is no replica failure)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import pytest

from heron.entrypoints.router_cli import add_router_parser, run_router
from heron.router.server import RouterServer
from tests.unit.test_router_framing import RawReplica, dechunked, run
from tests.unit.test_router_relay import post, raw_exchange


async def slow_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A healthy replica whose generation takes 1 s."""
    await asyncio.sleep(1.0)
    body = b'{"choices": [{"text": "done"}]}'
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (len(body), body))


async def slow_stream(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A healthy replica streaming one token every 0.2 s."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    for i in range(6):
        event = b'data: {"token": %d}\n\n' % i
        writer.write(b"%x\r\n%b\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.2)
    writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


def _no_failures(server: RouterServer) -> bool:
    return all(r.breaker.consecutive_failures == 0 and r.breaker.usable for r in server.replicas.replicas)


def test_an_answer_past_the_deadline_is_a_504_and_is_not_run_again_elsewhere():
    async def test(url: str, _: list, server: RouterServer) -> None:
        server.request_timeout = 0.3
        started = time.monotonic()
        answer = await raw_exchange(url, post("/v1/completions", {"max_tokens": 4000}, close=True))
        assert answer.startswith(b"HTTP/1.1 504"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
        assert time.monotonic() - started < 0.9  # one deadline, not one per replica tried
        assert sum(r.num_requests for r in server.replicas.replicas) == 1
        assert _no_failures(server)
        assert server.metrics.timeouts._value.get() == 1  # noqa: SLF001 (the counter's value)

    run(test, [RawReplica(slow_answer), RawReplica(slow_answer), RawReplica(slow_answer)])


def test_a_stream_past_the_deadline_ends_with_a_timeout_event_and_blames_no_replica():
    async def test(url: str, _: list, server: RouterServer) -> None:
        server.request_timeout = 0.5
        for _ in range(3):  # as many as open a breaker, were they failures
            answer = await raw_exchange(url, post("/v1/completions", {"stream": True}, close=True))
            assert answer.startswith(b"HTTP/1.1 200")
            events = dechunked(answer).split(b"\n\n")
            assert events[0] == b'data: {"token": 0}' and events[-2:] == [b"data: [DONE]", b""]
            assert json.loads(events[-3].removeprefix(b"data: "))["error"]["code"] == "timeout"
        assert _no_failures(server) and server.metrics.cut_streams._value.get() == 0  # noqa: SLF001

    run(test, [RawReplica(slow_stream)])


def test_no_deadline_unless_the_flag_sets_one(monkeypatch: pytest.MonkeyPatch):
    created: list[dict[str, Any]] = []

    class Recorded:
        def __init__(self, *_: Any, **kwargs: Any) -> None:
            created.append(kwargs)

        async def run(self, host: str, port: int, shutdown_timeout: float, bounds: Any) -> None:
            created[-1]["bounds"] = bounds

    monkeypatch.setattr("heron.router.server.RouterServer", Recorded)
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    for flags, timeout in (([], None), (["--request-timeout", "0"], None), (["--request-timeout", "1800"], 1800.0)):
        args = parser.parse_args(["router", "--replica", "http://127.0.0.1:1", "--policy", "round_robin", *flags])
        assert run_router(args) == 0
        assert created[-1]["bounds"].keep_alive_s == 20  # the default: longer than clients' pools keep one
        assert created.pop()["request_timeout"] == timeout
    args = parser.parse_args(["router", "--replica", "http://127.0.0.1:1", "--keep-alive-timeout", "75",
                              "--allowed-origins", "http://a.example,http://b.example"])
    assert run_router(args) == 0
    assert created[-1]["bounds"].keep_alive_s == 75
    assert created.pop()["allowed_origins"] == ("http://a.example", "http://b.example")


def created_replicas(run_with: list[str]) -> Any:
    """The ReplicaSet ``heron router`` builds from these flags (its server not run)."""
    from heron.router.replica import ReplicaSet

    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--replica", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2",
                              *run_with])
    built: list[ReplicaSet] = []
    original = ReplicaSet.__init__

    def record(self: ReplicaSet, *positional: Any, **keywords: Any) -> None:
        original(self, *positional, **keywords)
        built.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ReplicaSet, "__init__", record)
        patch.setattr("heron.router.server.RouterServer.run", lambda *_, **__: _done())
        assert run_router(args) == 0
    assert len(built) == 2 and built[0].timeout.total == built[1].timeout.total  # replicas and prefill replicas
    return built[0]


async def _done() -> None:
    return None


def test_the_probe_timeout_is_a_flag():
    """It was fixed at 2 s: a replica's API server answers once it has started
    (2 s here, more with several API servers or on a busy machine), and a probe
    timing out opened the breaker of a replica about to be ready (found by the
    fleet review)."""
    assert created_replicas(run_with=[]).timeout.total == 2.0  # the default
    assert created_replicas(run_with=["--probe-timeout", "7.5"]).timeout.total == 7.5


@pytest.mark.parametrize("flags, message", [
    (["--request-timeout", "-1"], ">= 0"),
    (["--port", "99999"], "port number"),
    (["--cache-weight", "inf"], "finite"),  # inf x 0 uncached blocks is NaN: no replica won, every request a 500
    (["--cache-weight", "nan"], "finite"),
    (["--imbalance-threshold", "-1"], ">= 0"),
    (["--probe-interval", "nan"], "> 0"),  # asyncio.sleep(nan) returned at once: a busy loop of probes
    (["--probe-interval", "0"], "> 0"),
    (["--probe-timeout", "0"], "> 0"),
    (["--max-attempts", "0"], ">= 1"),
    (["--shutdown-timeout", "inf"], "finite"),
])
def test_router_flags_out_of_range_are_usage_errors(flags, message, capsys):
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["router", "--replica", "http://127.0.0.1:1", *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--replica", "localhost:18151"], "must be http://HOST"),  # taken, then every request was a 503
    (["--replica", "http://127.0.0.1:99999"], "out of range"),
    (["--replica", "http://127.0.0.1:1", "--prefill", "ftp://x"], "must be http://HOST"),
    (["--replica", "http://127.0.0.1:18151/v1"], r"without /v1 .*: http://127.0.0.1:18151$"),  # every request a 503
    (["--replica", "http://127.0.0.1:18151/gw/v1/"], r"without /v1 .*: http://127.0.0.1:18151/gw$"),
    (["--replica", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2/?x=1"], "a query"),
])
def test_a_replica_url_or_port_the_router_cannot_use_is_refused_at_start(flags, message):
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    with pytest.raises(ValueError, match=message):
        run_router(parser.parse_args(["router", "--policy", "round_robin", *flags]))


def test_a_port_in_use_is_a_sentence_not_a_traceback():
    import socket

    from heron.router.replica import ReplicaSet
    from heron.router.server import RouterServer
    from heron.routing.policies import Router

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = RouterServer(ReplicaSet(["http://127.0.0.1:1"], {}), Router("round_robin"), None)
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            asyncio.run(server.run("127.0.0.1", port))
