"""An API server killed outright (SIGKILL: no shutdown) leaves nothing behind:
its engine core notices it is orphaned, removes the IPC sockets' directory the
API server made, and exits. The launcher of several API servers killed so
leaves no process, and its working directory is swept by the next heron that
makes one."""

from __future__ import annotations

import os
import signal
import time

from heron.tempdirs import sweep_stale_dirs
from tests.e2e.server_process import ServerProcess, descendants


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


def test_a_killed_launcher_of_api_servers_leaves_no_process_and_its_directory_is_swept():
    server = ServerProcess("--api-server-count", "2")
    try:
        family = descendants(server.process.pid)
        api_starts = [command.split()[-1] for command in family.values() if "api_server_proc" in command]
        assert len(api_starts) == 2
        workdir = os.path.dirname(api_starts[0])  # .../heron-api-XXXX/api-server-0.pickle
        assert os.path.basename(workdir).startswith("heron-api-") and os.path.isdir(workdir)
        assert workdir not in sweep_stale_dirs()  # its launcher lives
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{pid}") for pid in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in family), "a process outlived its launcher"
        assert os.path.isdir(workdir)  # nobody was left to remove it
        assert workdir in sweep_stale_dirs()
        assert not os.path.exists(workdir)
    finally:
        server.stop()
