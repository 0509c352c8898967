"""A stand-in engine-core process for API-side tests (no model): it connects to
an API server's IPC pair as ``engine/core_proc.py`` does, says READY, holds
every request it is given without running it, and answers ABORT as the real
one does (a finished "abort" output for each id it holds, unknown ids ignored).
A request whose id starts with "garbled" gets an OUTPUTS message that cannot
be decoded. It sends a heartbeat every second as the real one does; after a
request whose id starts with "stuck", its heartbeats say a step has been
running since (a step that never ends).

    python tests/unit/fake_engine_core.py INPUT_ADDRESS OUTPUT_ADDRESS
"""

from __future__ import annotations

import sys
import threading
import time

import zmq

from heron.engine.liveness import HEARTBEAT_INTERVAL_S
from heron.engine.serialization import MessageKind, encode_outputs, pack, unpack
from heron.step_outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


def main(input_address: str, output_address: str) -> None:
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs.send(pack(MessageKind.READY, {"num_kv_blocks": 100, "pid": 0, "resolved": {}}))
    sending = threading.Lock()  # a ZMQ socket is not thread-safe
    stuck_since: list[float] = []

    def send(message: bytes) -> None:
        with sending:
            outputs.send(message)

    def heartbeat() -> None:
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            send(pack(MessageKind.HEARTBEAT, {"step_s": time.monotonic() - stuck_since[0] if stuck_since else 0.0}))

    threading.Thread(target=heartbeat, daemon=True).start()
    held: set[str] = set()
    while True:
        kind, payload = unpack(inputs.recv())
        if kind == MessageKind.ADD:
            held.add(payload[0])
            if payload[0].startswith("stuck") and not stuck_since:
                stuck_since.append(time.monotonic())
            if payload[0].startswith("garbled"):  # answer with outputs nobody can decode (a version skew)
                send(pack(MessageKind.OUTPUTS, {"not": "outputs"}))
        elif kind == MessageKind.ABORT:
            gone = [request_id for request_id in payload if request_id in held]
            held.difference_update(gone)
            if gone:
                aborted = [EngineCoreOutput(request_id, [], finish_reason="abort") for request_id in gone]
                send(pack(MessageKind.OUTPUTS, encode_outputs(
                    EngineCoreOutputs(outputs=aborted, scheduler_stats=SchedulerStats()))))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
