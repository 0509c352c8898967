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
from heron.engine.serialization import MessageKind, decode_request, encode_outputs, pack, unpack
from heron.gc_freeze import freeze_startup_objects
from heron.step_outputs import EngineCoreOutputs

logger = logging.getLogger(__name__)

_STOP = object()


def _exit_when_orphaned(parent_pid: int) -> None:
    """If the API server dies without shutting us down, do not linger."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def run_engine_core(
    config: EngineConfig | EngineArgs, input_address: str, output_address: str, log_level: str = "INFO"
) -> None:
    """Process entry point (started by the API server's ``EngineCoreProcess``):
    ``config`` resolved, or the ``EngineArgs`` to resolve."""
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(
        level=getattr(logging, log_level, logging.INFO),
        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when we stop
    context = zmq.Context()
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 2000)
    output_socket.connect(output_address)
    try:
        if isinstance(config, EngineArgs):
            config = config.create_engine_config()
        engine = EngineCore(config)
    except BaseException as exc:  # report why start-up failed, then exit
        message = f"{type(exc).__name__}: {exc}"
        logger.error("engine core failed to start: %s\n%s", message, traceback.format_exc())
        output_socket.send(pack(MessageKind.FAILED, message))
        output_socket.close()
        context.term()
        os._exit(1)
    freeze_startup_objects("engine core")
    proc = EngineCoreProc(engine, context, input_address, output_socket)
    proc.run()


class EngineCoreProc:
    def __init__(self, engine: EngineCore, context: zmq.Context, input_address: str, output_socket: zmq.Socket) -> None:
        self.engine = engine
        self.input_queue: queue.Queue[tuple[MessageKind, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.input_socket = context.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.output_socket = output_socket
        self._running = True
        threading.Thread(target=self._receive_loop, name="engine-core-input", daemon=True).start()
        self._sender = threading.Thread(target=self._send_loop, name="engine-core-output", daemon=True)
        self._sender.start()
        model = engine.config.model
        self.output_queue.put(
            pack(
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
            )
        )

    def _receive_loop(self) -> None:
        while True:
            try:
                self.input_queue.put(unpack(self.input_socket.recv()))
            except zmq.ZMQError:
                return

    def _send_loop(self) -> None:
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                return
            self.output_socket.send(item)

    def _handle(self, kind: MessageKind, payload: Any) -> None:
        if kind == MessageKind.ADD:
            self.engine.add_request(decode_request(payload))
        elif kind == MessageKind.ABORT:
            outputs = self.engine.abort_requests(payload)
            if outputs:
                self._send(EngineCoreOutputs(outputs=outputs, scheduler_stats=self.engine.scheduler.make_stats()))
        elif kind == MessageKind.UTILITY:
            call_id, method, args = payload
            try:
                result = self._utility(method, args)
                self.output_queue.put(pack(MessageKind.UTILITY_RESULT, [call_id, True, result]))
            except Exception as exc:  # reported to the caller, the engine keeps running
                self.output_queue.put(
                    pack(MessageKind.UTILITY_RESULT, [call_id, False, f"{type(exc).__name__}: {exc}"])
                )
        elif kind == MessageKind.SHUTDOWN:
            self.engine.finish_profile()
            self.engine.shutdown()
            self._running = False

    def _utility(self, method: str, args: list[Any]) -> Any:
        if method == "reset_prefix_cache":
            return self.engine.reset_prefix_cache()
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
        self.output_queue.put(pack(MessageKind.OUTPUTS, encode_outputs(outputs)))

    def run(self) -> None:
        engine = self.engine
        try:
            while self._running:
                # block while idle; otherwise take whatever arrived since the last step
                block = not engine.has_unfinished_requests()
                while True:
                    try:
                        kind, payload = self.input_queue.get(block=block, timeout=1.0 if block else None)
                    except queue.Empty:
                        break
                    self._handle(kind, payload)
                    block = False
                if not self._running:
                    break
                if engine.has_unfinished_requests():
                    # sent even without token outputs: the step's stats feed the metrics
                    self._send(engine.step())
        except BaseException:
            logger.error("engine core died:\n%s", traceback.format_exc())
            self.output_queue.put(pack(MessageKind.FAILED, traceback.format_exc(limit=3)))
            raise
        finally:
            self.output_queue.put(_STOP)
            self._sender.join(timeout=5)


def main(argv: list[str]) -> None:
    """``python -m heron.engine.core_proc CONFIG_PICKLE INPUT OUTPUT LOG_LEVEL``"""
    config_path, input_address, output_address, log_level = argv
    with open(config_path, "rb") as config_file:
        config = pickle.load(config_file)
    os.unlink(config_path)
    run_engine_core(config, input_address, output_address, log_level)


if __name__ == "__main__":
    main(sys.argv[1:])
