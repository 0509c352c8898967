"""The port of ``heron serve --api-server-count M`` is the pool's alone: checked
free, then bound and listening before the API servers start (found by the
lifecycle review: a second pool on the port shared its connections, and a
server started meanwhile took the port from the starting API servers)."""

from __future__ import annotations

import socket

import pytest

from heron.entrypoints.openai.listen_socket import bind_shared_port, reserve_port


def plain_listener(port: int) -> socket.socket:
    """What an ordinary server (uvicorn, another heron) does with its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_second_pool_on_the_port_fails_at_once():
    first = reserve_port("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            reserve_port("127.0.0.1", port)
    finally:
        first.close()


def test_no_other_server_takes_the_port_while_the_api_servers_start():
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    try:
        with pytest.raises(OSError):
            plain_listener(port).close()
        beside = bind_shared_port("127.0.0.1", port)  # the other API servers join it
        beside.close()
        # a connection before any API server accepts waits in the queue, not refused
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        accepted, _ = reserved.accept()
        accepted.close()
        client.close()
    finally:
        reserved.close()


def test_a_port_another_server_holds_is_refused_with_a_sentence():
    other = plain_listener(0)
    try:
        with pytest.raises(ValueError, match="cannot listen on 127.0.0.1:.*in use"):
            reserve_port("127.0.0.1", other.getsockname()[1])
    finally:
        other.close()


def test_a_host_name_listens_on_ipv4_as_uvicorn_did(monkeypatch):
    """Where /etc/hosts names localhost ::1 too, the resolver may answer ::1
    first: heron listened there alone and clients of 127.0.0.1 were refused
    (found by the diff review)."""
    real = socket.getaddrinfo

    def v6_first(host, port, family=0, type=0, *args):
        if host == "localhost" and family == 0:
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                    *real("127.0.0.1", port, socket.AF_INET, type)]
        return real(host, port, family, type, *args)

    monkeypatch.setattr(socket, "getaddrinfo", v6_first)
    sock = bind_shared_port("localhost", 0, shared=False)
    try:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()
