"""An API server killed outright (SIGKILL: no shutdown) leaves nothing behind:
its engine core notices it is orphaned, removes the IPC sockets' directory the
API server made, and exits."""

from __future__ import annotations

import os
import signal
import time

from tests.e2e.server_process import ServerProcess


def test_a_killed_api_server_leaves_no_engine_core_and_no_socket_directory():
    server = ServerProcess()
    try:
        engine_pid = server.engine_core_pid(timeout=10)
        with open(f"/proc/{engine_pid}/cmdline", "rb") as cmdline:
            start_path = cmdline.read().split(b"\0")[-3].decode()  # ... START_PICKLE LOG_LEVEL
        socket_dir = os.path.dirname(start_path)
        assert os.path.basename(socket_dir).startswith("heron-ipc-") and os.path.isdir(socket_dir)
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{engine_pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{engine_pid}"), "the engine core outlived its API server"
        assert not os.path.exists(socket_dir)
    finally:
        server.stop()
