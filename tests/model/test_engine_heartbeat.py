"""The real engine core's heartbeat (engine/core_proc.py, engine/liveness.py):
it beats every second from a thread of its own, while idle and while a step
runs, and says how long the running step has taken, so the API server can tell
a stuck step (--engine-step-timeout) from a long one. An engine-core process
on a tiny model whose first step waits for the test (held_step_engine_core.py)."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

from heron.engine.args import EngineArgs
from heron.engine.core_channels import ClientAddresses
from heron.engine.core_client import EngineCoreClient, EngineCoreProcess
from heron.engine.serialization import MessageKind, decode_outputs
from heron.request import EngineCoreRequest
from heron.sampling_params import SamplingParams
from heron.tempdirs import IPC_DIR_PREFIX, make_private_dir

HELD_STEP_ENGINE = Path(__file__).with_name("held_step_engine_core.py")


def start_held_engine_core(config, release: Path) -> EngineCoreProcess:
    """``EngineCoreProcess.start``, with the held-step wrapper as the process."""
    socket_dir = make_private_dir(IPC_DIR_PREFIX)
    clients = [ClientAddresses(f"ipc://{socket_dir}/input-0", f"ipc://{socket_dir}/output-0")]
    start_path = os.path.join(socket_dir, "start.pickle")
    with open(start_path, "wb") as start_file:
        pickle.dump((config, clients), start_file)
    process = subprocess.Popen([sys.executable, str(HELD_STEP_ENGINE), start_path, "WARNING", str(release)])
    return EngineCoreProcess(process, socket_dir, clients)


def test_heartbeats_report_a_running_step_and_its_end(tiny_model_dir, tmp_path):
    config = EngineArgs(model=tiny_model_dir("llama"), dtype="float32", max_model_len=64,
                        device="cpu").create_engine_config()
    release = tmp_path / "release"

    async def scenario() -> None:
        client = EngineCoreClient(config, started=start_held_engine_core(config, release))
        try:
            while (await asyncio.wait_for(client.receive(), 120))[0] != MessageKind.READY:
                pass
            request = EngineCoreRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0),
                                        (), 2, time.monotonic())
            await client.add_request(request)
            beats: list[float] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (beats and beats[-1] >= 2.0):
                kind, payload = await asyncio.wait_for(client.receive(), 5)
                if kind == MessageKind.HEARTBEAT:
                    beats.append(payload["step_s"])
            assert beats and beats[-1] >= 2.0, beats  # the held step, growing one beat after another
            reason = client.hung_reason(30.0, 1.5)
            assert reason is not None and "is stuck" in reason
            assert client.hung_reason(30.0, 0.0) is None  # with no step timeout, a long step is no hang
            release.touch()
            finished = False
            while not finished:
                kind, payload = await asyncio.wait_for(client.receive(), 10)
                finished = kind == MessageKind.OUTPUTS and any(o.finished for o in decode_outputs(payload).outputs)
            while (await asyncio.wait_for(client.receive(), 5))[0] != MessageKind.HEARTBEAT:
                pass
            assert client.liveness.step_s_at_beat == 0.0  # idle: no step running
            assert client.hung_reason(30.0, 1.5) is None
        finally:
            release.touch()
            client.shutdown(5.0)

    asyncio.run(scenario())
