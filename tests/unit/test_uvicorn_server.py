"""An API server stops gracefully on its first Ctrl-C, even after a SIGTERM:
under --api-server-count the terminal's SIGINT and the launcher's SIGTERM reach
it in either order, and uvicorn's own server took SIGINT after SIGTERM as a
second Ctrl-C, cutting that API server's streams at once."""

from __future__ import annotations

import signal

import uvicorn

from heron.entrypoints.openai.uvicorn_server import Server


def server() -> Server:
    return Server(uvicorn.Config(app=lambda scope, receive, send: None))


def test_sigint_after_sigterm_is_still_a_graceful_stop():
    stopping = server()
    stopping.handle_exit(signal.SIGTERM, None)
    stopping.handle_exit(signal.SIGINT, None)
    assert stopping.should_exit and not stopping.force_exit
    stopping.handle_exit(signal.SIGINT, None)  # a second Ctrl-C: now
    assert stopping.force_exit


def test_two_ctrl_cs_force_the_exit_as_uvicorn_does():
    interrupted = server()
    interrupted.handle_exit(signal.SIGINT, None)
    assert interrupted.should_exit and not interrupted.force_exit
    interrupted.handle_exit(signal.SIGINT, None)
    assert interrupted.force_exit
    assert interrupted._captured_signals == [signal.SIGINT, signal.SIGINT]  # passed on after the stop, as uvicorn's
