"""A stand-in engine-core process for API-side tests (no model): it connects to
an API server's IPC pair as ``engine/core_proc.py`` does, says READY, holds
every request it is given without running it, and answers ABORT as the real
one does (a finished "abort" output for each id it holds, unknown ids ignored).
A request whose id starts with "garbled" gets an OUTPUTS message that cannot
be decoded.

    python tests/unit/fake_engine_core.py INPUT_ADDRESS OUTPUT_ADDRESS
"""

from __future__ import annotations

import sys

import zmq

from heron.engine.serialization import MessageKind, encode_outputs, pack, unpack
from heron.step_outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


def main(input_address: str, output_address: str) -> None:
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs.send(pack(MessageKind.READY, {"num_kv_blocks": 100, "pid": 0, "resolved": {}}))
    held: set[str] = set()
    while True:
        kind, payload = unpack(inputs.recv())
        if kind == MessageKind.ADD:
            held.add(payload[0])
            if payload[0].startswith("garbled"):  # answer with outputs nobody can decode (a version skew)
                outputs.send(pack(MessageKind.OUTPUTS, {"not": "outputs"}))
        elif kind == MessageKind.ABORT:
            gone = [request_id for request_id in payload if request_id in held]
            held.difference_update(gone)
            if gone:
                aborted = [EngineCoreOutput(request_id, [], finish_reason="abort") for request_id in gone]
                outputs.send(pack(MessageKind.OUTPUTS, encode_outputs(
                    EngineCoreOutputs(outputs=aborted, scheduler_stats=SchedulerStats()))))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
