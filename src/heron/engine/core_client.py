"""The API server's handle on the engine-core process: spawns it, and sends and
receives msgpack messages over two ZMQ IPC sockets (asyncio).

The process may be started before the API server has resolved its own config
(``EngineCoreProcess.start`` with the ``EngineArgs``): both
processes then resolve the same arguments at once, and the engine core reports
what it resolved in its ready message so the two are checked to agree."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from heron.config import EngineConfig
from heron.engine.args import EngineArgs
from heron.engine.core_channels import ClientAddresses
from heron.engine.cpu_slices import pin, slice_environment
from heron.engine.input_processor import InvalidRequestError
from heron.engine.liveness import EngineLiveness
from heron.engine.serialization import LOAD_FAILED_EXIT_CODE, MessageKind, encode_request, pack, unpack
from heron.request import EngineCoreRequest
from heron.tempdirs import IPC_DIR_PREFIX, make_private_dir, remove_private_dir

logger = logging.getLogger(__name__)


# the exit code of an engine core another process started (an API server of several): it ended, how is unknown
UNKNOWN_EXIT_CODE = -1


@contextlib.contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """SIGINT ignored while a child starts: an ignored disposition survives exec,
    so an engine core ignores a terminal's Ctrl-C from its first instruction (it
    did so only once its imports were done: a Ctrl-C during start-up printed a
    KeyboardInterrupt traceback from them). The API server decides when it stops."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


@dataclass(frozen=True)
class EngineCoreEndpoint:
    """What one API server needs to talk to an engine core another process
    started (``pid``: a local process, None for one on another machine)."""

    pid: int | None
    addresses: ClientAddresses


class OwnedEngineCore(Protocol):
    """An engine core a client may own: a local process, or a Ray actor."""

    def endpoint(self, client: int) -> EngineCoreEndpoint: ...

    def exit_code(self) -> int | None:
        """None while it runs."""

    def how_it_ended(self) -> str | None:
        """Once it has ended, how, where more is known than its exit code (a Ray actor's death)."""

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for it to end by itself; whether it did."""

    def stop(self, timeout: float = 5.0) -> None:
        """End it (politely, then not) and release what it held."""

    def kill(self) -> None:
        """End it at once (no client was made for it)."""


@dataclass
class EngineCoreProcess:
    """A started engine-core process and the IPC addresses of each API server it
    talks to (one, unless ``heron serve --api-server-count`` asked for more)."""

    process: subprocess.Popen[bytes]
    socket_dir: str
    clients: list[ClientAddresses]

    @staticmethod
    def start(engine: EngineConfig | EngineArgs, log_level: str = "INFO", num_clients: int = 1,
              cpus: Sequence[int] | None = None) -> EngineCoreProcess:
        """Start the process on a resolved config, or on ``EngineArgs`` (it
        resolves them itself, so it can start loading before the caller has
        imported torch). ``cpus``: the CPUs it is pinned to, with as many
        OpenMP threads (``cpu_slices.py``; None: this process's CPUs and threads)."""
        socket_dir = make_private_dir(IPC_DIR_PREFIX)
        clients = [
            ClientAddresses(f"ipc://{os.path.join(socket_dir, f'input-{index}')}",
                            f"ipc://{os.path.join(socket_dir, f'output-{index}')}")
            for index in range(num_clients)
        ]
        # A fresh interpreter (not multiprocessing's spawn, which re-imports the
        # caller's __main__): the config travels as a pickle file.
        start_path = os.path.join(socket_dir, "start.pickle")
        with open(start_path, "wb") as start_file:
            pickle.dump((engine, clients), start_file)
        # our PID: it exits when we are gone, also when we die before it has started watching
        with _sigint_ignored_by_children():
            process = subprocess.Popen([sys.executable, "-m", "heron.engine.core_proc", start_path, log_level,
                                        str(os.getpid())], env=slice_environment(cpus))
        pin(process.pid, cpus)
        return EngineCoreProcess(process, socket_dir, clients)

    def endpoint(self, client: int) -> EngineCoreEndpoint:
        return EngineCoreEndpoint(self.process.pid, self.clients[client])

    def exit_code(self) -> int | None:
        return self.process.poll()

    def how_it_ended(self) -> str | None:
        return None  # its exit code says it

    def wait(self, timeout: float) -> bool:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the process (then kill it) and remove its sockets' directory."""
        for stop in (self.process.terminate, self.process.kill):
            if self.process.poll() is not None:
                break
            stop()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                continue
        remove_private_dir(self.socket_dir)

    def kill(self) -> None:
        """Stop a process no client was made for (the caller's config failed)."""
        self.process.kill()
        self.process.wait()
        remove_private_dir(self.socket_dir)


class EngineCoreClient:
    def __init__(
        self, config: EngineConfig, log_level: str = "INFO",
        started: OwnedEngineCore | EngineCoreEndpoint | None = None,
    ) -> None:
        """``started``: an engine core already started on ``config``'s arguments
        (this client owns it), or the endpoint of one another process owns (this
        client never stops it); else a process is started."""
        started = started or EngineCoreProcess.start(config, log_level)
        self._owned = None if isinstance(started, EngineCoreEndpoint) else started
        endpoint = started if isinstance(started, EngineCoreEndpoint) else started.endpoint(0)
        self.pid = endpoint.pid
        self.context = zmq.asyncio.Context()
        # one side binds, the other connects; ZMQ retries until both are there
        addresses = endpoint.addresses
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        if addresses.engine_binds:  # an engine core on another machine
            self.input_socket.connect(addresses.input_address)
            self.output_socket.connect(addresses.output_address)
        else:
            self.input_socket.bind(addresses.input_address)
            self.output_socket.bind(addresses.output_address)
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future[Any]] = {}
        self._closed = False
        self.liveness = EngineLiveness()

    def is_alive(self) -> bool:
        return self.exit_code is None

    def hung_reason(self, heartbeat_timeout_s: float, step_timeout_s: float) -> str | None:
        """Why the engine core counts as hung though its process exists (``liveness.py``), or None."""
        return self.liveness.hung_reason(heartbeat_timeout_s, step_timeout_s)

    @property
    def exit_code(self) -> int | None:
        if self._owned is not None:
            return self._owned.exit_code()
        return None if self.pid is None or _process_running(self.pid) else UNKNOWN_EXIT_CODE

    def could_not_load(self) -> bool:
        """Whether the engine core exited as one that could not load the model."""
        return self.exit_code == LOAD_FAILED_EXIT_CODE

    def exit_reason(self) -> str:
        """What to tell clients once the engine core is no longer alive."""
        code = self.exit_code
        how = self._owned.how_it_ended() if self._owned is not None else None
        if how is not None:
            return how
        return "the engine core process exited" + ("" if code in (None, UNKNOWN_EXIT_CODE) else f" (code {code})")

    async def add_request(self, request: EngineCoreRequest) -> None:
        try:
            message = pack(MessageKind.ADD, encode_request(request))
        except OverflowError as exc:  # a client's number beyond msgpack's 64-bit integers: its input, not a fault
            raise InvalidRequestError(f"a number in the request is out of range ({exc})") from exc
        await self.input_socket.send(message)

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed:
            await self.input_socket.send(pack(MessageKind.ABORT, request_ids))

    async def receive(self) -> tuple[MessageKind, Any]:
        kind, payload = unpack(await self.output_socket.recv())
        if kind == MessageKind.HEARTBEAT:
            self.liveness.heartbeat(payload)
        else:
            self.liveness.heard()
        if kind == MessageKind.UTILITY_RESULT:
            call_id, ok, result = payload
            future = self._pending_calls.pop(call_id, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(result)
                else:
                    future.set_exception(RuntimeError(result))
        return kind, payload

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run a named utility in the engine core (e.g. "reset_prefix_cache")."""
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        await self.input_socket.send(pack(MessageKind.UTILITY, [call_id, method, list(args)]))
        try:
            async with asyncio.timeout(timeout):  # never wait_for: 3.11's can swallow a cancel
                return await future
        finally:
            self._pending_calls.pop(call_id, None)

    def fail_pending_calls(self, error: BaseException) -> None:
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(error)
        self._pending_calls.clear()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Close the sockets; an owned process is asked to stop (once it has spoken), then terminated."""
        if self._closed:
            return
        self._closed = True
        owned = self._owned
        # asked to stop, a serving core finishes what it holds; one still loading the model (nothing heard from it
        # yet) reads the word only once loaded: waiting for it held a Ctrl-C during a start 5 s per core
        if owned is not None and owned.exit_code() is None and self.liveness.last_heard is not None:
            try:
                _settle(self.input_socket.send(pack(MessageKind.SHUTDOWN, None), flags=zmq.NOBLOCK))
                owned.wait(timeout)
            except zmq.ZMQError:
                pass
        self.input_socket.close()
        self.output_socket.close()
        self.context.term()
        if owned is not None:
            owned.stop(timeout)


def _settle(sent: object) -> None:
    """Mark an asyncio socket's send future as seen. A NOBLOCK send that finds no
    peer (an engine core not yet connected, or gone) fails into the future rather
    than raising, and asyncio would log its never-read error as a traceback; the
    caller stops the process anyway."""
    if not isinstance(sent, asyncio.Future):
        return
    if sent.done():
        if not sent.cancelled():
            sent.exception()
    else:
        sent.add_done_callback(lambda done: done.cancelled() or done.exception())


def _process_running(pid: int) -> bool:
    """Whether ``pid`` (not necessarily our child) is alive: a zombie is not."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
