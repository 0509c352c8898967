"""Shutting a client down while its engine core is not connected yet (a server
whose port is taken exits at once) sends SHUTDOWN without blocking; that send's
failure must not surface as asyncio's "exception was never retrieved" traceback.

An engine core still loading its model has said nothing yet, and would read the
polite stop word only once loaded, so the client ends it at once. It waited the
whole timeout first (5 s a core: a Ctrl-C during a two-rank start took over 10 s
to give the terminal back)."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from typing import Any, cast

import zmq
import zmq.asyncio

from heron.engine.core_channels import ClientAddresses
from heron.engine.core_client import EngineCoreClient, EngineCoreProcess, _settle
from heron.tempdirs import IPC_DIR_PREFIX, make_private_dir


def test_a_failed_nonblocking_send_is_settled():
    async def sends() -> list[str]:
        logged: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: logged.append(context["message"]))
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind("inproc://no-engine-core")  # no peer: a NOBLOCK send fails (EAGAIN) into its future
        unsettled = socket.send(b"shutdown", flags=zmq.NOBLOCK)
        settled = socket.send(b"shutdown", flags=zmq.NOBLOCK)
        _settle(settled)
        del unsettled, settled
        gc.collect()
        await asyncio.sleep(0)
        socket.close()
        context.term()
        return logged

    assert asyncio.run(sends()) == ["Future exception was never retrieved"]  # the unsettled one only


def loading_engine_core() -> EngineCoreProcess:
    """A process in an engine core's place that never connects (as one importing torch and loading a model)."""
    socket_dir = make_private_dir(IPC_DIR_PREFIX)
    clients = [ClientAddresses(f"ipc://{socket_dir}/input-0", f"ipc://{socket_dir}/output-0")]
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    return EngineCoreProcess(process, socket_dir, clients)


def test_a_core_still_loading_is_ended_without_waiting_for_it():
    core = loading_engine_core()
    client = EngineCoreClient(cast(Any, None), started=core)
    assert client.liveness.last_heard is None
    started = time.monotonic()
    client.shutdown(timeout=5.0)
    assert time.monotonic() - started < 2.5
    assert core.exit_code() is not None
    assert not os.path.exists(core.socket_dir)
