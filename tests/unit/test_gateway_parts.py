import asyncio
import hmac

import pytest

from heron.engine.async_llm import RequestOutputCollector
from heron.entrypoints.openai.cli_args import collect_api_keys
from heron.entrypoints.openai.errors import APIError
from heron.entrypoints.openai.gateway import APIKeyChecker, TokenBucketLimiter
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import RequestOutputKind


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_allows_bursts_then_refills_per_key():
    clock = FakeClock()
    limiter = TokenBucketLimiter(rate=2.0, burst=3, clock=clock)
    for _ in range(3):
        limiter.acquire("a")
    with pytest.raises(APIError) as info:
        limiter.acquire("a")
    assert info.value.status_code == 429 and info.value.headers == {"Retry-After": "1"}
    limiter.acquire("b")  # other keys are unaffected
    clock.now = 0.5  # one token refilled at 2/s
    limiter.acquire("a")
    with pytest.raises(APIError):
        limiter.acquire("a")


def test_api_key_checker_and_sources(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfile-key\n\n")
    monkeypatch.setenv("HERON_API_KEY", "env-1, env-2")
    keys = collect_api_keys(["flag-key", "env-1"], str(key_file))
    assert keys == ["flag-key", "env-1", "env-2", "file-key"]
    checker = APIKeyChecker(keys)
    assert checker.check("Bearer file-key") == "file-key"
    for header in (None, "Bearer nope", "Basic env-1", "env-1"):
        with pytest.raises(APIError) as info:
            checker.check(header)
        assert info.value.status_code == 401
    assert APIKeyChecker([]).check(None) == ""


def test_api_key_check_compares_fixed_length_digests_with_every_key(monkeypatch):
    """Timing tells nothing: every comparison is of two 32-byte digests (not of
    the presented key, whose length would show), every key is compared even
    when the first one matches, and the checker keeps no key in the clear."""
    keys = ["short", "a-much-longer-key-" * 4, "third"]
    checker = APIKeyChecker(keys)
    assert not any(key.encode() in repr(vars(checker)).encode() for key in keys)
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for presented, accepted in (("short", True), ("third", True), ("x", False), ("y" * 5000, False)):
        compared.clear()
        if accepted:
            assert checker.check(f"Bearer {presented}") == presented
        else:
            with pytest.raises(APIError):
                checker.check(f"Bearer {presented}")
        assert compared == [(32, 32)] * len(keys), (presented, compared)


def output(text: str, finished: bool = False, index: int = 0) -> RequestOutput:
    completion = CompletionOutput(index, text, [len(text)], finish_reason="stop" if finished else None)
    return RequestOutput("r", None, [1], [completion], finished)


def test_collector_merges_deltas_for_a_slow_reader():
    async def run() -> None:
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        for piece in ("a", "b", "c"):
            collector.put(output(piece))
        collector.put(output("d", finished=True))
        merged = await collector.get()
        assert merged.outputs[0].text == "abcd" and merged.outputs[0].token_ids == [1, 1, 1, 1]
        assert merged.finished and merged.outputs[0].finish_reason == "stop"
        collector.put(output("x", index=1))
        collector.put(output("y", index=0))
        both = await collector.get()
        assert sorted((c.index, c.text) for c in both.outputs) == [(0, "y"), (1, "x")]
        collector.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await collector.get()

    asyncio.run(run())


def test_a_reader_that_lags_holds_one_merged_output_not_one_per_delta():
    """A stream whose client stopped reading holds its unread tokens once (text
    and ids, bounded by max_tokens), not an object per engine step."""
    import tracemalloc

    async def run() -> tuple[int, RequestOutput]:
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for step in range(20_000):
            completion = CompletionOutput(0, " w", [1000 + step % 500])
            collector.put(RequestOutput("r", None, [1], [completion], False))
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return held, await collector.get()

    held, merged = asyncio.run(run())
    assert len(merged.outputs) == 1 and len(merged.outputs[0].token_ids) == 20_000
    assert merged.outputs[0].text == " w" * 20_000
    # ~43 bytes a token (an int object, its list slot, 2 characters); a queued RequestOutput per step: several hundred
    assert held < 20_000 * 64, held


def test_an_indented_comment_is_no_key_and_a_key_that_can_never_match_is_refused(tmp_path):
    """An indented "# retired: old-key" line became a valid key; a non-ASCII key
    could never match the header a client sends (read as latin-1)."""
    key_file = tmp_path / "keys"
    key_file.write_text("real-key\n  # retired: old-key\n")
    assert collect_api_keys(None, str(key_file)) == ["real-key"]
    with pytest.raises(ValueError, match="printable ASCII"):
        collect_api_keys(["clé-secrète"], None)


def test_a_key_source_that_names_no_key_is_refused(tmp_path, monkeypatch):
    """A key file of comments only, or HERON_API_KEY=",", started a server that
    took every request without a key, saying nothing."""
    key_file = tmp_path / "keys"
    key_file.write_text("# keys rotated out; add new ones here\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        collect_api_keys(None, str(key_file))
    monkeypatch.setenv("HERON_API_KEY", ",")
    with pytest.raises(ValueError, match="names no key"):
        collect_api_keys(None, None)
    monkeypatch.setenv("HERON_API_KEY", "")  # set but empty: unset
    assert collect_api_keys(None, None) == []


def test_a_key_file_that_reads_once_is_read_once(monkeypatch):
    """--api-key-file <(vault read ...): the launcher's check read the pipe, and
    the server, reading it again, found no key and took every request."""
    import os

    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.openai.cli_args import check_serve_args
    from heron.entrypoints.openai.server import gateway_settings_from_args

    monkeypatch.delenv("HERON_API_KEY", raising=False)
    read_end, write_end = os.pipe()
    os.write(write_end, b"sk-from-vault\n")
    os.close(write_end)
    try:
        args = build_parser().parse_args(["serve", "--api-key-file", f"/dev/fd/{read_end}"])
        check_serve_args(args)
        assert gateway_settings_from_args(args).api_keys == ["sk-from-vault"]
    finally:
        os.close(read_end)


@pytest.mark.parametrize("allow, seen", [(None, "127.0.0.1"), ("127.0.0.1", "10.0.0.7")])
def test_x_forwarded_for_names_the_client_only_from_a_trusted_proxy(allow, seen):
    """uvicorn's default trusted X-Forwarded-For from 127.0.0.1: without API keys
    (the rate limit keyed by the client's address) a local client named itself
    anyone and got a fresh bucket each request."""
    import asyncio
    import socket

    import httpx
    import uvicorn

    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.openai.server import GatewaySettings, uvicorn_config

    clients: list[str] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        clients.append(scope["client"][0])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["serve", "--port", str(port)] + (["--forwarded-allow-ips", allow] if allow else [])
    server = uvicorn.Server(uvicorn_config(app, build_parser().parse_args(argv), GatewaySettings(api_keys=[])))

    async def main() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            await client.get(f"http://127.0.0.1:{port}/", headers={"X-Forwarded-For": "10.0.0.7"})
        server.should_exit = True
        await serving

    asyncio.run(main())
    assert clients == [seen]


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "port number"),  # an OverflowError traceback once the engine had loaded
    (["--port", "-1"], "port number"),
    (["--request-timeout", "0"], "> 0"),  # every request a 504
    (["--max-waiting-requests", "0"], ">= 1"),  # every request a 429
    (["--rate-limit", "nan"], "> 0"),  # limited nothing
    (["--rate-limit", "0"], "> 0"),
    (["--rate-limit-burst", "0.5"], ">= 1"),  # refused only once the engine core had started
])
def test_serve_flags_out_of_range_are_usage_errors(flags, message, capsys):
    from heron.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_tls_file_is_named(tmp_path):
    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.openai.cli_args import check_serve_args

    missing = str(tmp_path / "key.pem")
    with pytest.raises(ValueError, match=f"--ssl-keyfile '{missing}': no such file"):  # "[Errno 2]", naming none
        check_serve_args(build_parser().parse_args(["serve", "--ssl-keyfile", missing]))


def test_a_key_file_alone_or_one_without_its_certificate_is_refused(tmp_path):
    """uvicorn's bare AssertionError, after the engine core had started."""
    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.openai.cli_args import check_serve_args

    key = tmp_path / "key.pem"
    key.write_text("unused")
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-certfile go together"):
        check_serve_args(build_parser().parse_args(["serve", "--ssl-keyfile", str(key)]))
    with pytest.raises(ValueError, match="go together"):
        check_serve_args(build_parser().parse_args(["serve", "--ssl-certfile", str(key)]))


@pytest.mark.parametrize("key", ["", " padded", "padded\t"])
def test_an_empty_or_padded_key_is_refused(key):
    """``--api-key "$UNSET"`` turned keys on with "", and ``Bearer `` (httptools
    keeps the space), ``Bearer \\xa0`` or ``Bearer \\x85`` matched it; a padded
    key could never match (the presented key is trimmed)."""
    with pytest.raises(ValueError, match="must not be empty nor begin or end with whitespace"):
        collect_api_keys([key], None)


def test_only_http_spaces_are_trimmed_from_the_presented_key():
    checker = APIKeyChecker(["k"])
    assert checker.check("Bearer  k \t") == "k"
    for header in ("Bearer \xa0k", "Bearer k\x85"):  # str.strip() took these too
        with pytest.raises(APIError):
            checker.check(header)


def test_retry_after_is_never_short_of_the_wait():
    """2.0002 s of waiting said 2: a client waiting exactly as told was refused again."""
    from heron.entrypoints.openai.errors import too_many_requests

    assert too_many_requests("m", 2.0002, "c").headers == {"Retry-After": "3"}
    assert too_many_requests("m", 2.0, "c").headers == {"Retry-After": "2"}
    assert too_many_requests("m", 0.01, "c").headers == {"Retry-After": "1"}


def test_the_bucket_map_forgets_the_least_recently_seen_key_in_constant_time(monkeypatch):
    """Past 100,000 keys every new client rebuilt the whole map (55 ms each on
    the event loop) and kept every key seen within the hour."""
    from heron.entrypoints.openai import gateway

    monkeypatch.setattr(gateway, "MAX_BUCKETS", 3)
    clock = FakeClock()
    limiter = TokenBucketLimiter(rate=1.0, burst=1, clock=clock)
    for key in ("a", "b", "c"):
        limiter.acquire(key)
    with pytest.raises(APIError):
        limiter.acquire("a")  # "a" was seen again: now the most recent
    limiter.acquire("d")  # "b" goes
    assert list(limiter._buckets) == ["c", "a", "d"]
    with pytest.raises(APIError):
        limiter.acquire("a")  # kept, still empty


@pytest.mark.parametrize("body_limit, key, status", [(10**10, "Bearer wrong", b"401"), (10**6, "Bearer k", b"413")])
def test_a_refusal_before_the_body_closes_the_connection(body_limit, key, status):
    """A 401 (or a 413) sent before the body was read left the connection open,
    and the server read and dropped every byte the client declared: 2 GB, or
    10 GB in 10 s, with no key needed."""
    import socket

    from heron.entrypoints.openai.gateway import GatewayMiddleware
    from heron.entrypoints.openai.http_limits import RequestSizeLimitMiddleware

    async def app(scope, receive, send):  # never reached: both requests are refused
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guarded = RequestSizeLimitMiddleware(GatewayMiddleware(app, APIKeyChecker(["k"]), None), body_limit, 65536)

    def exchange(port: int) -> tuple[bytes, int]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {key}\r\n"
                           "Content-Type: application/json\r\nContent-Length: 2000000000\r\n\r\n".encode())
            sent = 0
            answer = b""
            try:
                for _ in range(200):  # keep sending body, as a client streaming its upload does
                    client.sendall(b"x" * 65536)
                    sent += 65536
            except OSError:  # the server closed: what it would have read is no longer sent
                pass
            while chunk := client.recv(65536):
                answer += chunk
            return answer, sent

    answer, sent = serve_while(guarded, exchange)
    assert answer.startswith(b"HTTP/1.1 " + status) and b"connection: close" in answer.lower(), answer[:300]
    assert sent < 200 * 65536  # the server closed before the client had sent it all


async def _reading_app(scope, receive, send):
    """Reads the body, then answers "ok"; /stream: six events a quarter of a second apart, then "end"."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if scope["path"] == "/stream":
        for index in range(6):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % index, "more_body": True})
            await asyncio.sleep(0.25)
        await send({"type": "http.response.body", "body": b"end"})
        return
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def short_bounds(monkeypatch):
    """The connection time bounds at half a second (heron/http_bounds.py)."""
    from heron import http_bounds

    monkeypatch.setattr(http_bounds, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http_bounds, "BODY_IDLE_TIMEOUT_S", 0.5)


def test_a_head_or_a_body_that_stalls_is_cut_off(short_bounds):
    """A client that sent part of a head, or of a body, and stopped held its
    connection for ever (slowloris: enough of them took every descriptor);
    one that never sent a byte too."""
    import time

    app = _reading_app

    def held_for(port: int, first_bytes: bytes) -> tuple[float, bytes]:
        """Seconds until the server closed a connection that sent ``first_bytes`` and stopped."""
        started = time.monotonic()
        answer = read_all(port, first_bytes)
        return time.monotonic() - started, answer

    firsts = (
        b"",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: a",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a whole request: answered, then kept alive (5 s here)
    )
    (idle, _), (head, head_answer), (body, _), (whole, whole_answer) = serve_while(
        app, lambda port: [held_for(port, first) for first in firsts], ("--keep-alive-timeout", "5"))
    assert idle < 5 and head < 5 and body < 5, (idle, head, body)
    assert head_answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in head_answer
    assert whole_answer.startswith(b"HTTP/1.1 200") and whole >= 4  # the timers never cut a served request


def test_a_pipelined_request_never_cuts_the_answer_before_it(short_bounds):
    """uvicorn stops reading behind a pipelined request while the answer before
    it runs: the stalled-body bound cut that stream, and a head's bound wrote
    its 408 into it."""
    import socket
    import time

    app = _reading_app

    def exchange(port: int, pieces: list[bytes]) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            for piece in pieces:
                client.sendall(piece)
                time.sleep(0.3)
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
            return answer

    stream = b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
    post = b"POST /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 5\r\n\r\n"
    for pieces in ([stream, post, b"hello"], [stream + post[:10], post[10:] + b"hello"]):  # a body, a head apart
        answer = serve_while(app, lambda port, pieces=pieces: exchange(port, pieces))
        assert answer.count(b"HTTP/1.1 200") == 2 and b"408" not in answer, answer
        assert b"data: 5\n\n\r\n3\r\nend" in answer and answer.endswith(b"ok\r\n0\r\n\r\n"), answer[-80:]


def test_a_chunked_upload_before_a_pipelined_request_is_no_oversized_head():
    """The chunks' framing was counted as the next request's head: a false 431."""
    import socket

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"%d" % size})

    upload = (b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\na\r\n" * 10000
              + b"0\r\n\r\nGET /next HT")

    def exchange(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(upload)
            time.sleep(0.2)
            client.sendall(b"TP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
            return answer

    import time

    answer = serve_while(app, exchange)
    assert answer.count(b"HTTP/1.1 200") == 2 and b"10000" in answer, answer[:300]


@pytest.mark.parametrize("flags, expected", [
    ([], None),  # off by default: no cross-origin page reads an answer
    (["--allowed-origins", "http://localhost:3000,https://app.example"],
     ("http://localhost:3000", "https://app.example")),
    (["--allowed-origins", '["http://a.example"]', "--allowed-origins", "*"], ("http://a.example", "*")),  # vLLM's form
])
def test_allowed_origins_are_read_as_a_list(flags, expected):
    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.openai.cors import cors_settings_from_args

    settings = cors_settings_from_args(build_parser().parse_args(["serve", *flags]))
    assert (settings.allowed_origins if settings else None) == expected


@pytest.mark.parametrize("origin", ["localhost:3000", "http://app.example/", "http://app.example/chat", "ftp://x",
                                    '["http://a", 3]', "http://a,,http://b"])
def test_an_origin_a_browser_could_never_send_is_a_usage_error(origin, capsys):
    from heron.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--allowed-origins", origin])
    assert exited.value.code == 2 and "--allowed-origins" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--allowed-origins", "*", "--allow-credentials"], "not '\\*'"),  # any site could act as the user
    (["--allowed-methods", "GET"], "--allowed-methods does nothing without --allowed-origins"),
    (["--allow-credentials"], "--allow-credentials does nothing"),
])
def test_cors_flags_that_would_mislead_are_refused_before_start(flags, message):
    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.openai.cli_args import check_serve_args

    with pytest.raises(ValueError, match=message):
        check_serve_args(build_parser().parse_args(["serve", *flags]))


def serve_while(app, work, flags: tuple[str, ...] = ()):
    """Run ``app`` under uvicorn with ``heron serve``'s protocol (and ``flags``)
    on a free port, call ``work(port)`` on a thread, stop the server, return its
    result."""
    import asyncio
    import socket

    import uvicorn

    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.openai.server import GatewaySettings, uvicorn_config

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, build_parser().parse_args(["serve", "--port", str(port), *flags]),
                                           GatewaySettings(api_keys=[])))

    async def main():
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            return await asyncio.to_thread(work, port)
        finally:
            server.should_exit = True
            await serving

    return asyncio.run(main())


def read_all(port: int, sent: bytes) -> bytes:
    """What the server answers to ``sent`` until it closes the connection."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=20) as client:
        client.sendall(sent)
        answer = b""
        while chunk := client.recv(4096):
            answer += chunk
        return answer


@pytest.mark.parametrize("sent", [b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"])
def test_a_request_that_cannot_be_parsed_gets_an_openai_shaped_400(sent):
    """uvicorn answered it in text/plain, the one error not in OpenAI's shape."""
    import json

    async def app(scope, receive, send):  # never reached
        raise AssertionError("an unparsable request reached the app")

    answer = serve_while(app, lambda port: read_all(port, sent))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), answer
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request", error


def _answers_after_idle(port: int, idle_s: float) -> bytes:
    """The second answer on one kept-alive connection, sent ``idle_s`` after the
    first answer was read (b"" when the server closed it meanwhile)."""
    import socket
    import time

    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=20) as client:
        client.sendall(request)
        first = b""
        while not first.endswith(b"\r\n\r\nok"):  # the head and the body may come apart
            first += client.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(idle_s)
        try:
            client.sendall(request)
            return client.recv(4096)
        except ConnectionResetError:
            return b""


async def _ok_app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def test_an_idle_connection_outlives_the_clients_pool_expiry():
    """httpx (the openai client's) reuses a connection idle up to 5 s: uvicorn's
    own 5 s closed it at the same moment, and a request sent then was reset (the
    overload test's ReadError in CI)."""
    assert serve_while(_ok_app, lambda port: _answers_after_idle(port, 6.0)).startswith(b"HTTP/1.1 200")


def test_keep_alive_timeout_closes_an_idle_connection():
    answer = serve_while(_ok_app, lambda port: _answers_after_idle(port, 1.5), ("--keep-alive-timeout", "0.5"))
    assert answer == b""


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_keep_alive_timeout_must_be_a_positive_number(value, capsys):
    from heron.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--keep-alive-timeout", value])
    assert "--keep-alive-timeout" in capsys.readouterr().err


async def _streaming_app(scope, receive, send):
    """An answer of unknown length in two parts (as a stream's is), or a sized one for /sized."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/sized":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@pytest.mark.parametrize("path", ["/", "/sized"])
def test_an_http10_client_gets_no_chunked_framing(path):
    """uvicorn framed a stream to an HTTP/1.0 request in chunks, whose size
    lines such a client reads as part of the text (RFC 9112 forbids it)."""
    answer = serve_while(_streaming_app, lambda port: read_all(port, f"GET {path} HTTP/1.0\r\n\r\n".encode()))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower(), head
    assert body == (b"ok" if path == "/sized" else b"data: 1\n\ndata: [DONE]\n\n")


def test_an_http11_client_still_gets_a_stream_in_chunks():
    answer = serve_while(_streaming_app, lambda port: read_all(port, b"GET / HTTP/1.1\r\nhost: x\r\n"
                                                                     b"connection: close\r\n\r\n"))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower() and body.endswith(b"0\r\n\r\n")


def test_an_http10_stream_cut_short_ends_with_a_reset():
    """Unframed, its end is the connection's: a plain close after the app failed
    read as the whole answer."""
    import socket

    async def failing(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise RuntimeError("the app failed half way")

    def exchange(port: int) -> str:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"GET / HTTP/1.0\r\n\r\n")
            try:
                while client.recv(65536):
                    pass
            except ConnectionResetError:
                return "reset"
            return "closed"

    assert serve_while(failing, exchange) == "reset"
    assert serve_while(_streaming_app, exchange) == "closed"  # a whole answer ends with a close


def test_a_body_that_trickles_is_cut_off(short_bounds, monkeypatch):
    """A byte every 0.3 s never let the 0.5 s idle bound run out (a byte every
    25 s against 60 s held a connection for hours)."""
    import socket
    import time

    from heron import http_bounds

    monkeypatch.setattr(http_bounds, "BODY_MIN_RATE", 100.0)

    def trickle(port: int) -> float:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            try:
                while time.monotonic() - started < 8:
                    client.sendall(b"a")
                    time.sleep(0.3)
            except OSError:  # closed by the server
                pass
        return time.monotonic() - started

    assert serve_while(_reading_app, trickle) < 4


def test_unknown_field_names_are_logged_quoted_cut_and_counted():
    """A field named "x\\n23:59:59 ERROR ..." forged a log line of its own, and
    one of 5 MB wrote 5 MB of log a request."""
    from heron.entrypoints.openai.serving_common import loggable_names

    forged = "x\n23:59:59 ERROR heron.engine.async_llm: engine core died"
    line = loggable_names([forged, "A" * 5_000_000, "a", "b", "c", "d", "e"])
    assert "\n" not in line and len(line) < 600
    assert line.startswith("'x\\n23:59:59 ERROR") and line.endswith("and 2 more")
    assert loggable_names(["frobnicate"]) == "'frobnicate'"


def test_503s_while_loading_spend_none_of_the_rate_limit():
    """A client polling a loading server (503s) arrived at readiness with its
    bucket emptied by its own polls: its first real request was a 429."""
    from heron.entrypoints.openai import errors
    from heron.entrypoints.openai.gateway import GatewayMiddleware

    loading = [True]

    def unavailable() -> APIError | None:
        return errors.unavailable("the model is still loading", "model_loading") if loading[0] else None

    limiter = TokenBucketLimiter(rate=0.001, burst=2, clock=FakeClock())
    gateway = GatewayMiddleware(None, APIKeyChecker(["k"]), limiter, unavailable)
    scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", b"Bearer k")],
             "client": ("127.0.0.1", 1)}
    for _ in range(5):
        refusal = gateway._refusal(dict(scope))
        assert refusal is not None and refusal.status_code == 503
    assert gateway._refusal({**scope, "headers": []}).status_code == 401  # the key is still checked first
    loading[0] = False
    assert gateway._refusal(dict(scope)) is None and gateway._refusal(dict(scope)) is None
    assert gateway._refusal(dict(scope)).status_code == 429
