"""Shutting a client down while its engine core is not connected yet (a server
whose port is taken exits at once) sends SHUTDOWN without blocking; that send's
failure must not surface as asyncio's "exception was never retrieved" traceback."""

from __future__ import annotations

import asyncio
import gc

import zmq
import zmq.asyncio

from heron.engine.core_client import _settle


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
