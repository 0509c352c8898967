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
    """Where one API server talks to one engine core. The API server binds both
    and the engine core connects (IPC on one host), or the other way round
    (``engine_binds``: TCP, an engine core on another machine binds its node's
    address and the API server connects)."""

    input_address: str
    output_address: str
    engine_binds: bool = False


class ClientChannels:
    def __init__(self, inputs: list[zmq.Socket], outputs: list[zmq.Socket], addresses: list[ClientAddresses]) -> None:
        """A PULL and a PUSH socket per API server (``connected`` or ``bound``)."""
        if not inputs or len(inputs) != len(outputs):
            raise ValueError("an engine core needs a socket pair per API server, and at least one")
        self.inputs = inputs
        self.outputs = outputs
        self.addresses = addresses
        self.tagged = len(inputs) > 1

    @classmethod
    def connected(cls, context: zmq.Context, clients: Sequence[ClientAddresses]) -> ClientChannels:
        """Connect to API servers that bound ``clients``' addresses."""
        outputs = [_socket(context, zmq.PUSH, client.output_address, bind=False) for client in clients]
        inputs = [_socket(context, zmq.PULL, client.input_address, bind=False) for client in clients]
        return cls(inputs, outputs, list(clients))

    @classmethod
    def bound(cls, context: zmq.Context, host: str, num_clients: int) -> ClientChannels:
        """Bind a pair of TCP sockets per API server on ``host`` (ports the
        system picks; ``addresses`` says which), for API servers to connect to."""
        outputs = [_socket(context, zmq.PUSH, f"tcp://{host}:*", bind=True) for _ in range(num_clients)]
        inputs = [_socket(context, zmq.PULL, f"tcp://{host}:*", bind=True) for _ in range(num_clients)]
        addresses = [ClientAddresses(_bound_address(pull), _bound_address(push), engine_binds=True)
                     for pull, push in zip(inputs, outputs, strict=True)]
        return cls(inputs, outputs, addresses)

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

    def send_failure(self, message: str, timeout_ms: int = 5000, kind: MessageKind = MessageKind.FAILED) -> None:
        """Tell every API server why this engine core cannot go on (waiting at
        most ``timeout_ms`` for one that has not connected)."""
        failure = pack(kind, message)
        for socket in self.outputs:
            socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
            try:
                socket.send(failure)
            except zmq.Again:
                pass

    def close(self) -> None:
        for socket in self.inputs + self.outputs:
            socket.close()


def _socket(context: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    socket = context.socket(kind)
    if kind == zmq.PUSH:
        socket.setsockopt(zmq.LINGER, 2000)  # the last outputs (a failure report) still go out
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket


def _bound_address(socket: zmq.Socket) -> str:
    address = socket.getsockopt(zmq.LAST_ENDPOINT)
    return address.decode() if isinstance(address, bytes) else str(address)
