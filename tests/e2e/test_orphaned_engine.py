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


def start_pickle(pid: int) -> str:
    """The start pickle a heron child process was given on its command line."""
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        [path] = [arg.decode() for arg in cmdline.read().split(b"\0") if arg.endswith(b".pickle")]
    return path


def wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_an_engine_core_whose_launcher_died_while_it_imported_exits():
    """The orphan watch took the parent's PID when it started, after seconds of
    imports: a launcher killed in that time left an engine core whose parent
    was already init, which loaded the model and stayed for good. It is held
    stopped here from its first moments until its launcher is gone."""
    server = ServerProcess(wait_ready=False)
    engine_pid = None
    try:
        engine_pid = server.engine_core_pid(timeout=30)
        os.kill(engine_pid, signal.SIGSTOP)  # found within 10 ms of its start: long before its imports end
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        os.kill(engine_pid, signal.SIGCONT)
        assert wait_gone([engine_pid], 60), "the engine core outlived its launcher"
    finally:
        if engine_pid is not None and os.path.exists(f"/proc/{engine_pid}"):
            os.kill(engine_pid, signal.SIGKILL)
        server.stop()


def test_sigterm_while_the_server_starts_is_a_clean_stop():
    """Before the server installed its graceful handler, SIGTERM's default action
    killed it outright (exit -15): a service manager stopping a server that was
    still loading saw it die, and its directories were left behind."""
    server = ServerProcess(wait_ready=False)
    try:
        engine_pid = server.engine_core_pid(timeout=30)  # started: the API server is still starting up
        socket_dir = os.path.dirname(start_pickle(engine_pid))
        os.kill(server.process.pid, signal.SIGTERM)
        assert server.process.wait(30) == 0, server.read_log()
        assert wait_gone([engine_pid], 30), "the engine core outlived its launcher"
        assert not os.path.exists(socket_dir)
    finally:
        server.stop()


def test_a_killed_api_server_leaves_no_engine_core_and_no_socket_directory():
    server = ServerProcess()
    try:
        engine_pid = server.engine_core_pid(timeout=10)
        socket_dir = os.path.dirname(start_pickle(engine_pid))
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
        api_starts = [start_pickle(pid) for pid, command in family.items() if "api_server_proc" in command]
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
