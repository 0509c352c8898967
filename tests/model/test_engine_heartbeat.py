"""The real engine core's heartbeat (engine/core_proc.py, engine/liveness.py):
it beats every second from a thread of its own, while idle and while a step
runs, and says how long the running step has taken, so the API server can tell
a stuck step (--engine-step-timeout) from a long one. Run in this process on a
tiny model, its step held on an event."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import zmq

from heron.engine.args import EngineArgs
from heron.engine.core import EngineCore
from heron.engine.core_channels import ClientAddresses, ClientChannels
from heron.engine.core_client import EngineCoreClient, EngineCoreEndpoint
from heron.engine.core_proc import EngineCoreProc
from heron.engine.serialization import MessageKind, decode_outputs, pack
from heron.request import EngineCoreRequest
from heron.sampling_params import SamplingParams


def test_heartbeats_report_a_running_step_and_its_end(tiny_model_dir, tmp_path):
    config = EngineArgs(model=tiny_model_dir("llama"), dtype="float32", max_model_len=64,
                        device="cpu").create_engine_config()
    engine = EngineCore(config)
    release = threading.Event()
    real_step = engine.step

    def held_step():  # the first step waits for the test: a step that does not end
        release.wait(60)
        return real_step()

    engine.step = held_step  # type: ignore[method-assign]
    addresses = ClientAddresses(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")

    async def scenario() -> None:
        client = EngineCoreClient(config, started=EngineCoreEndpoint(os.getpid(), addresses))
        context = zmq.Context()
        proc = EngineCoreProc(engine, ClientChannels.connected(context, [addresses]))
        runner = threading.Thread(target=proc.run, daemon=True)
        runner.start()
        try:
            assert (await client.receive())[0] == MessageKind.READY
            request = EngineCoreRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0),
                                        (), 2, time.monotonic())
            await client.add_request(request)
            beats: list[float] = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not (beats and beats[-1] >= 2.0):
                kind, payload = await asyncio.wait_for(client.receive(), 5)
                if kind == MessageKind.HEARTBEAT:
                    beats.append(payload["step_s"])
            assert beats and beats[-1] >= 2.0, beats  # the held step, growing one beat after another
            reason = client.hung_reason(30.0, 1.5)
            assert reason is not None and "is stuck" in reason
            assert client.hung_reason(30.0, 0.0) is None  # with no step timeout, a long step is no hang
            release.set()
            finished = False
            while not finished:
                kind, payload = await asyncio.wait_for(client.receive(), 10)
                finished = kind == MessageKind.OUTPUTS and any(o.finished for o in decode_outputs(payload).outputs)
            while (await asyncio.wait_for(client.receive(), 5))[0] != MessageKind.HEARTBEAT:
                pass
            assert client.liveness.step_s_at_beat == 0.0  # idle: no step running
            assert client.hung_reason(30.0, 1.5) is None
        finally:
            release.set()
            await client.input_socket.send(pack(MessageKind.SHUTDOWN, None))
            runner.join(10)
            client.shutdown(0.1)
            proc.channels.close()
            context.term()
        assert not runner.is_alive()

    asyncio.run(scenario())
