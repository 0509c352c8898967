"""The engine-core process: a busy loop around ``EngineCore.step()``.

Two I/O threads keep ZMQ and msgpack off the loop: one receives and decodes
messages from the API server into a queue, the other encodes and sends step
outputs. Torch releases the GIL during the forward pass, so decoding new
requests and sending outputs overlap the model's work. When there is nothing to
run, the loop blocks on the input queue instead of spinning.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from heron.config import EngineConfig
from heron.engine.args import EngineArgs
from heron.engine.core import EngineCore
from heron.engine.core_channels import ALL, ClientAddresses, ClientChannels
from heron.engine.liveness import HEARTBEAT_INTERVAL_S
from heron.engine.serialization import LOAD_FAILED_EXIT_CODE, MessageKind, decode_request, pack
from heron.gc_freeze import freeze_startup_objects
from heron.launcher_watch import exit_when_launcher_gone
from heron.step_outputs import EngineCoreOutput, EngineCoreOutputs
from heron.tempdirs import IPC_DIR_PREFIX

logger = logging.getLogger(__name__)

_STOP = object()


# what a failed start reports as the user's to fix (as ``heron generate`` does: its CLI's usage errors); any other
# exception (a bug, a full disk, memory) keeps its traceback and exit code 1
LOAD_ERRORS = (ValueError, FileNotFoundError)


def _remove_socket_dirs(clients: list[ClientAddresses]) -> None:
    """The IPC sockets' directory, which an API server killed outright can no longer remove."""
    for client in clients:
        for address in (client.input_address, client.output_address):
            directory = os.path.dirname(address.removeprefix("ipc://"))
            if address.startswith("ipc://") and os.path.basename(directory).startswith(IPC_DIR_PREFIX):
                shutil.rmtree(directory, ignore_errors=True)


def run_engine_core(
    config: EngineConfig | EngineArgs, clients: list[ClientAddresses], log_level: str = "INFO",
    launcher_pid: int | None = None,
) -> None:
    """Process entry point (started by the API server's ``EngineCoreProcess``):
    ``config`` resolved, or the ``EngineArgs`` to resolve; ``clients``: where
    each API server talks to it; ``launcher_pid``: the process that started it
    (None: its parent now), without which it does not linger."""
    configure_engine_logging(log_level)
    exit_when_launcher_gone(os.getppid() if launcher_pid is None else launcher_pid,
                            lambda: _remove_socket_dirs(clients), "engine core")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when we stop
    context = zmq.Context()
    channels = ClientChannels.connected(context, clients)
    try:
        engine = build_engine(config, channels)
    except BaseException as exc:  # reported; exit without running anyone's cleanup
        channels.close()
        context.term()
        os._exit(LOAD_FAILED_EXIT_CODE if isinstance(exc, LOAD_ERRORS) else 1)
    freeze_startup_objects("engine core")
    proc = EngineCoreProc(engine, channels)
    proc.run()


def configure_engine_logging(log_level: str) -> None:
    """An engine core's log lines: marked ``engine-core``, in the API server's format."""
    logging.basicConfig(
        level=getattr(logging, log_level, logging.INFO),
        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def build_engine(config: EngineConfig | EngineArgs, channels: ClientChannels) -> EngineCore:
    """Resolve the arguments and load the model; on failure tell every API
    server why, then raise."""
    try:
        if isinstance(config, EngineArgs):
            config = config.create_engine_config()
        return EngineCore(config)
    except LOAD_ERRORS as exc:  # the model's files or the arguments: said in one line (traceback: DEBUG)
        logger.error("engine core failed to start: %s%s", exc,
                     "" if logger.isEnabledFor(logging.DEBUG) else " (--log-level DEBUG logs where)")
        logger.debug("%s", traceback.format_exc())
        channels.send_failure(str(exc), kind=MessageKind.LOAD_FAILED)
        raise
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}"
        logger.error("engine core failed to start: %s\n%s", message, traceback.format_exc())
        channels.send_failure(message)
        raise


class EngineCoreProc:
    def __init__(self, engine: EngineCore, channels: ClientChannels) -> None:
        self.engine = engine
        self.channels = channels
        self.input_queue: queue.Queue[tuple[int, MessageKind, Any]] = queue.Queue()
        # (target, message), or outputs to split among the API servers, or _STOP
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._running = True
        self._step_started: float | None = None  # monotonic time the running step began (None: between steps)
        threading.Thread(target=channels.receive_loop, args=(self._put_input,), name="engine-core-input",
                         daemon=True).start()
        self._sender = threading.Thread(target=self._send_loop, name="engine-core-output", daemon=True)
        self._sender.start()
        threading.Thread(target=self._heartbeat_loop, name="engine-core-heartbeat", daemon=True).start()
        model = engine.config.model
        self._put_output(ALL, pack(
                MessageKind.READY,
                {
                    "num_kv_blocks": engine.scheduler.kv_cache_manager.num_blocks,
                    "max_model_len": model.max_model_len,
                    "pid": os.getpid(),
                    "compute_path": engine.model_runner.compute_path,
                    "resolved": engine.config.resolved_summary(),
                    "kv_events": engine.kv_events_info(),
                    "block_size": engine.config.cache.block_size,
                },
        ))
        # the figures of an engine that has run no step yet (a disk tier's blocks found at start): an idle
        # server's /metrics showed none until its first request
        self._send(EngineCoreOutputs(outputs=[], scheduler_stats=engine.scheduler.make_stats()))

    def _put_input(self, client: int, kind: MessageKind, payload: Any) -> None:
        self.input_queue.put((client, kind, payload))

    def _put_output(self, target: int, message: bytes) -> None:
        self.output_queue.put((target, message))

    def _send_loop(self) -> None:
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                return
            if isinstance(item, EngineCoreOutputs):
                for target, message in self.channels.split(item):
                    self.channels.send(target, message)
            else:
                self.channels.send(*item)

    def _heartbeat_loop(self) -> None:
        """Tell every API server this process still runs, and how long its current step has
        (``liveness.py``): neither a stopped process nor a stuck step ever exits."""
        while self._running:
            time.sleep(HEARTBEAT_INTERVAL_S)
            started = self._step_started
            step_s = 0.0 if started is None else max(time.monotonic() - started, 1e-3)
            self._put_output(ALL, pack(MessageKind.HEARTBEAT, {"step_s": step_s}))

    def _handle(self, client: int, kind: MessageKind, payload: Any) -> None:
        if kind == MessageKind.ADD:
            try:
                request = decode_request(payload)
            except Exception as exc:  # noqa: BLE001 (a request the API side passed and this side cannot read
                # fails alone: it stopped the engine for everyone)
                logger.error("refused a request that could not be read: %s: %s", type(exc).__name__, exc)
                if isinstance(payload, list) and payload and isinstance(payload[0], str):
                    self._refuse(self.channels.tag(client, payload[0]))
                return
            request.request_id = self.channels.tag(client, request.request_id)
            try:
                self.engine.add_request(request)
            except ValueError as exc:  # an id still held here (a lease, a load): that request fails, not the engine
                logger.warning("refused a request: %s", exc)
                self._refuse(request.request_id)
        elif kind == MessageKind.ABORT:
            outputs = self.engine.abort_requests([self.channels.tag(client, rid) for rid in payload])
            if outputs:
                self._send(EngineCoreOutputs(outputs=outputs, scheduler_stats=self.engine.scheduler.make_stats()))
        elif kind == MessageKind.UTILITY:
            call_id, method, args = payload
            try:
                reply = [call_id, True, self._utility(method, args)]
            except Exception as exc:  # reported to the caller, the engine keeps running
                reply = [call_id, False, f"{type(exc).__name__}: {exc}"]
            self._put_output(client, pack(MessageKind.UTILITY_RESULT, reply))
        elif kind == MessageKind.SHUTDOWN:
            self.engine.shutdown()
            self._running = False

    def _refuse(self, request_id: str) -> None:
        """Ends a request the engine did not take (its caller sees it aborted)."""
        self._send(EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [], finish_reason="abort")],
                                     scheduler_stats=self.engine.scheduler.make_stats()))

    def _utility(self, method: str, args: list[Any]) -> Any:
        if method == "prefix_cache_idle":
            return self.engine.prefix_cache_idle()
        if method == "reset_prefix_cache":
            reset = self.engine.reset_prefix_cache()
            if reset:  # the tiers' gauges show the empty cache now, not after the next step
                self._send(EngineCoreOutputs(outputs=[], scheduler_stats=self.engine.scheduler.make_stats()))
            return reset
        if method == "release_remote_prefill":
            return self.engine.release_remote_prefill(*args)
        if method == "check_integrity":
            self.engine.scheduler.kv_cache_manager.check_integrity()
            return True
        if method == "stats":
            stats = self.engine.scheduler.make_stats()
            return {
                "num_running_reqs": stats.num_running_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs,
                "kv_cache_usage": stats.kv_cache_usage,
                "num_free_blocks": self.engine.scheduler.kv_cache_manager.num_free_blocks,
                "num_blocks": self.engine.scheduler.kv_cache_manager.num_blocks,
            }
        raise ValueError(f"unknown utility {method!r}")

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self.output_queue.put(outputs)  # split and encoded by the sender thread

    def run(self) -> None:
        engine = self.engine
        try:
            while self._running:
                # block while idle; otherwise take whatever arrived since the last step
                block = not engine.has_unfinished_requests()
                while True:
                    try:
                        client, kind, payload = self.input_queue.get(block=block, timeout=1.0 if block else None)
                    except queue.Empty:
                        break
                    self._handle(client, kind, payload)
                    block = False
                if not self._running:
                    break
                if engine.has_unfinished_requests():
                    # sent even without token outputs: the step's stats feed the metrics
                    self._step_started = time.monotonic()
                    outputs = engine.step()
                    self._step_started = None
                    self._send(outputs)
        except SystemExit as exc:  # told to exit (Ray's kill of its actor, at a stop): no traceback to read
            logger.warning("engine core stopped (exit %s)", exc.code)
            self._put_output(ALL, pack(MessageKind.FAILED, f"the engine core was stopped (exit {exc.code})"))
            raise
        except BaseException:
            logger.error("engine core died:\n%s", traceback.format_exc())
            self._put_output(ALL, pack(MessageKind.FAILED, traceback.format_exc(limit=3)))
            raise
        finally:
            self.output_queue.put(_STOP)
            self._sender.join(timeout=5)


def main(argv: list[str]) -> None:
    """``python -m heron.engine.core_proc START_PICKLE LOG_LEVEL [LAUNCHER_PID]``:
    the pickle holds the config and the API servers' addresses."""
    start_path, log_level, *launcher = argv
    try:
        with open(start_path, "rb") as start_file:
            config, clients = pickle.load(start_file)
    except FileNotFoundError:
        if os.path.isdir(os.path.dirname(start_path) or "."):
            raise
        # the launcher removed its private directory before this process read its start file: it was
        # stopped while starting (a Ctrl-C, a SIGTERM) and has gone; nothing to serve, nothing to say
        sys.exit(0)
    os.unlink(start_path)
    run_engine_core(config, clients, log_level, int(launcher[0]) if launcher else None)


if __name__ == "__main__":
    main(sys.argv[1:])
