"""The engine core's connections to its API servers.

One API server (the usual case): a PULL socket for its messages and a PUSH
socket for outputs, as before. Several (``heron serve --api-server-count M``):
a pair per API server. Inside the engine a request id is then tagged with the
index of the API server that sent it (``"<index>:<id>"``), so ids chosen by two
API servers (a client's ``request_id`` field, say) never collide, and each
step's outputs are split back by that tag. Every API server gets every step's
scheduler statistics: each places requests by them.

Threads: the receive loop owns the input sockets, the sender the output
sockets (``send_failure`` runs before either starts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import zmq

from heron.engine.serialization import MessageKind, encode_outputs, pack, unpack
from heron.step_outputs import EngineCoreOutputs

# an outgoing message's target: an API server's index, or every API server
ALL = -1


@dataclass(frozen=True)
class ClientAddresses:
    """Where one API server talks to one engine core (it binds both; the engine core connects)."""

    input_address: str
    output_address: str


class ClientChannels:
    def __init__(self, context: zmq.Context, clients: Sequence[ClientAddresses]) -> None:
        if not clients:
            raise ValueError("an engine core needs at least one API server to talk to")
        self.outputs = []
        for client in clients:
            socket = context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 2000)
            socket.connect(client.output_address)
            self.outputs.append(socket)
        self.inputs = []
        for client in clients:
            socket = context.socket(zmq.PULL)
            socket.connect(client.input_address)
            self.inputs.append(socket)
        self.tagged = len(clients) > 1

    # ---- incoming (receive thread) ---------------------------------------------------

    def receive_loop(self, put: Callable[[int, MessageKind, Any], None]) -> None:
        """Hand every message to ``put(client, kind, payload)`` until the sockets close."""
        poller = zmq.Poller()
        for socket in self.inputs:
            poller.register(socket, zmq.POLLIN)
        try:
            while True:
                if not self.tagged:
                    put(0, *unpack(self.inputs[0].recv()))
                    continue
                for socket, _ in poller.poll():
                    put(self.inputs.index(socket), *unpack(socket.recv()))
        except zmq.ZMQError:
            return

    def tag(self, client: int, request_id: str) -> str:
        return f"{client}:{request_id}" if self.tagged else request_id

    # ---- outgoing (sender thread) -------------------------------------------------------

    def split(self, outputs: EngineCoreOutputs) -> list[tuple[int, bytes]]:
        """A step's outputs as messages: each API server gets its requests'
        outputs (ids untagged) and the step's statistics."""
        if not self.tagged:
            return [(0, pack(MessageKind.OUTPUTS, encode_outputs(outputs)))]
        per_client: list[list[Any]] = [[] for _ in self.outputs]
        for output in outputs.outputs:
            client, _, request_id = output.request_id.partition(":")
            per_client[int(client)].append(replace(output, request_id=request_id))
        return [(client, pack(MessageKind.OUTPUTS, encode_outputs(replace(outputs, outputs=own))))
                for client, own in enumerate(per_client) if own or outputs.scheduler_stats is not None]

    def send(self, target: int, message: bytes) -> None:
        for socket in self.outputs if target == ALL else (self.outputs[target],):
            socket.send(message)

    def send_failure(self, message: str) -> None:
        self.send(ALL, pack(MessageKind.FAILED, message))

    def close(self) -> None:
        for socket in self.inputs + self.outputs:
            socket.close()
