"""The socket ``heron serve`` listens on, taken before the engine cores start:
a port in use fails at once with a sentence (it failed after the model had
loaded, with uvicorn's bare errno), and connections arriving while the model
loads wait in the socket's queue (then get a 503 until it is ready) rather
than being refused.

Several API servers (``--api-server-count``) share the port: the launcher
checks it free, then binds it with ``SO_REUSEPORT`` and listens
(``reserve_port``); the first API server serves that socket, the others bind
beside it (``bind_shared_port``) and the kernel spreads new connections among
them.
"""

from __future__ import annotations

import socket

# connections a listening socket queues before an API server accepts them (uvicorn's default)
LISTEN_BACKLOG = 2048


def bind_shared_port(host: str, port: int, shared: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening), with ``SO_REUSEPORT``
    unless not ``shared`` (then it fails on a port anyone holds, sharers too)."""
    # IPv4 unless the host is an IPv6 address, as uvicorn binds: "localhost" resolved to ::1 first (where
    # /etc/hosts names both) listened on ::1 alone, and clients of 127.0.0.1 were refused
    try:
        found = socket.getaddrinfo(host, port, socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:  # a name with IPv6 addresses alone
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, address = found[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:  # in use, or not this host's address: a sentence, not a traceback
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """The pool's port, checked free and then bound with ``SO_REUSEPORT`` and
    listening (see the module's docstring). A second pool on the port shared
    its connections with the first; a server started while this one's API
    servers started took the port from them."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("--api-server-count > 1 needs SO_REUSEPORT (Linux, macOS or BSD)")
    probe = bind_shared_port(host, port, shared=False)
    port = probe.getsockname()[1]  # --port 0: the port the probe got
    probe.close()
    sock = bind_shared_port(host, port)
    sock.listen(LISTEN_BACKLOG)
    return sock


def listen_alone(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that no other may share."""
    sock = bind_shared_port(host, port, shared=False)
    sock.listen(LISTEN_BACKLOG)
    return sock


def open_listener(host: str, port: int, api_server_count: int) -> socket.socket:
    """The socket ``heron serve`` answers on, for one API server or several."""
    return reserve_port(host, port) if api_server_count > 1 else listen_alone(host, port)
