"""The data-parallel client (engine/dp_client.py) and AsyncLLM over stand-in
engine-core processes (tests/unit/fake_engine_core.py, no model): a request
that never reaches its engine leaves no load counted there, a request placed
on an engine that just died ends with EngineDeadError instead of waiting for
ever, and the merged statistics count a step's tokens once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from heron.engine.args import EngineArgs
from heron.engine.async_llm import AsyncLLM, EngineDeadError
from heron.engine.core_channels import ClientAddresses
from heron.engine.core_client import EngineCoreEndpoint
from heron.engine.dp_client import DataParallelClient, _Engine
from heron.engine.input_processor import InvalidRequestError, ProcessedPrompt
from heron.engine.serialization import MessageKind
from heron.request import EngineCoreRequest
from heron.sampling_params import SamplingParams
from heron.step_outputs import EngineCoreOutputs, SchedulerStats

FAKE_ENGINE = Path(__file__).with_name("fake_engine_core.py")
ROOT = Path(__file__).resolve().parents[2]


def config(data_parallel_size: int = 2):
    return EngineArgs(device="cpu", max_model_len=256, data_parallel_size=data_parallel_size,
                      usage="serve").create_engine_config()


@pytest.fixture
def fake_engines(tmp_path):
    processes: list[subprocess.Popen] = []

    def start(count: int) -> tuple[list[subprocess.Popen], list[EngineCoreEndpoint]]:
        endpoints = []
        for rank in range(count):
            addresses = ClientAddresses(f"ipc://{tmp_path}/in-{rank}", f"ipc://{tmp_path}/out-{rank}")
            process = subprocess.Popen([sys.executable, str(FAKE_ENGINE), addresses.input_address,
                                        addresses.output_address], cwd=ROOT)
            processes.append(process)
            endpoints.append(EngineCoreEndpoint(process.pid, addresses))
        return processes, endpoints

    yield start
    for process in processes:
        process.kill()
        process.wait()


def test_a_request_that_never_reaches_its_engine_is_not_counted_there(fake_engines):
    _, endpoints = fake_engines(2)

    async def scenario() -> None:
        client = DataParallelClient(config(), endpoints)
        try:
            while (await client.receive())[0] != MessageKind.READY:
                pass
            for index in range(3):  # a number msgpack cannot carry: the client gets a 400
                request = EngineCoreRequest(f"bad-{index}", list(range(1, 41)),  # two full blocks
                                            SamplingParams(kv_transfer_params={"x": 2**64}), (0,), 8,
                                            time.monotonic())
                with pytest.raises(InvalidRequestError):
                    await client.add_request(request)
                await client.abort_requests([request.request_id])  # what AsyncLLM does next
            assert client._owner == {}
            for engine in client.engines:
                assert engine.load.in_flight == 0 and engine.load.pending_blocks == 0
                assert not engine.index.expected  # its prompt's blocks are not expected there either
            assert client.requests_per_engine() == [0, 0]
        finally:
            client.shutdown(0.1)

    asyncio.run(scenario())


def test_a_request_placed_on_an_engine_that_just_died_ends_with_an_error(fake_engines):
    processes, endpoints = fake_engines(2)

    async def scenario() -> None:
        llm = AsyncLLM(config(), started=endpoints)
        try:
            await llm.wait_until_ready(timeout=30)
            llm.client.router.policy = "round_robin"
            next(llm.client.router._turn)  # the next request goes to engine 1
            processes[1].kill()
            processes[1].wait()
            stream = llm.generate(ProcessedPrompt("hi", [1, 2, 3]), SamplingParams(max_tokens=4), "r")
            with pytest.raises(EngineDeadError):  # within the engine watch's period, not never
                await asyncio.wait_for(anext(stream), 10)
            # which of the engines died (the message was one engine's, with no rank)
            assert llm.dead_reason == "engine core 1: the engine core process exited"
        finally:
            llm.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("num_engines", [1, 2])
def test_outputs_that_cannot_be_read_mark_the_engine_dead(fake_engines, num_engines):
    """The loop reading an engine's outputs used to end in silence on a message
    it could not handle: every request waited for ever and /health said ok."""
    _, endpoints = fake_engines(num_engines)

    async def scenario() -> None:
        llm = AsyncLLM(config(num_engines), started=endpoints)
        try:
            await llm.wait_until_ready(timeout=30)
            stream = llm.generate(ProcessedPrompt("hi", [1, 2, 3]), SamplingParams(max_tokens=4), "garbled-1")
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(anext(stream), 10)
            assert llm.is_dead and "could not be read" in (llm.dead_reason or "")
        finally:
            llm.shutdown()

    asyncio.run(scenario())


def test_merged_statistics_count_a_steps_tokens_once():
    client = DataParallelClient.__new__(DataParallelClient)  # _merge needs no sockets
    client.engines = [_Engine(0, None), _Engine(1, None)]
    client._owner = {}
    merged = []
    for rank, tokens in [(1, 512), (0, 1), (0, 1)]:  # engine 1 prefilled, then went quiet
        outputs = client._merge(client.engines[rank],
                                EngineCoreOutputs(scheduler_stats=SchedulerStats(num_scheduled_tokens=tokens,
                                                                                 num_running_reqs=1)))
        merged.append((outputs.scheduler_stats.num_scheduled_tokens, outputs.scheduler_stats.num_running_reqs))
    assert merged == [(512, 1), (1, 2), (1, 2)]  # running requests add up over engines, a step's tokens do not


def test_merged_kv_usage_is_the_mean_over_every_engine():
    """An engine that had not reported yet (no request since the start) was
    left out of the mean: one busy engine of two read 0.59 where 0.30 was used."""
    client = DataParallelClient.__new__(DataParallelClient)
    client.engines = [_Engine(0, None), _Engine(1, None)]
    client._owner = {}
    usage = []
    for rank, used in [(0, 0.6), (1, 0.2)]:
        outputs = client._merge(client.engines[rank], EngineCoreOutputs(scheduler_stats=SchedulerStats(
            kv_cache_usage=used)))
        usage.append(outputs.scheduler_stats.kv_cache_usage)
    assert usage == pytest.approx([0.3, 0.4])


def test_an_engines_kv_event_subscription_that_ends_is_followed_again(fake_engines, monkeypatch):
    """It was started once: had it ended, the client would have placed prompts
    by what that engine held then, for good."""
    from heron.config import KVEventsConfig
    from heron.core.kv_events import BlockStored
    from heron.engine import dp_client
    from heron.engine.kv_events_publisher import ZmqEventPublisher
    from heron.routing.kv_subscriber import KVEventSubscriber

    class FailsOnce(KVEventSubscriber):
        failed = False

        async def run(self) -> None:
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("a fault the subscriber did not expect")
            await super().run()

    monkeypatch.setattr(dp_client, "KVEventSubscriber", FailsOnce)
    monkeypatch.setattr(dp_client, "RESUBSCRIBE_DELAY_S", 0.05)
    _, endpoints = fake_engines(1)
    publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*"))

    async def scenario() -> None:
        client = DataParallelClient(config(1), endpoints)
        engine = client.engines[0]
        try:
            engine.index.blocks.add(b"s" * 32)  # what the ended subscription had seen
            client._follow(engine, {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint})
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not (FailsOnce.failed and client._subscriptions):
                await asyncio.sleep(0.02)
            assert b"s" * 32 not in engine.index.blocks  # forgotten, not trusted
            await asyncio.sleep(0.3)  # the new one has joined
            publisher.publish([BlockStored([b"n" * 32], None, [1], 1)])
            while time.monotonic() < deadline and b"n" * 32 not in engine.index.blocks:
                await asyncio.sleep(0.02)
            assert b"n" * 32 in engine.index.blocks
        finally:
            client.shutdown(0.1)
            publisher.shutdown()

    asyncio.run(scenario())
