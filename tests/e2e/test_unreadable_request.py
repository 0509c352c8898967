"""The engine core refuses a request it cannot read, alone: the request ends
(aborted), and the engine goes on serving everyone else. A request the API
server passed and the core could not decode (their checks of a structured-output
constraint once disagreed) stopped the engine core for every client."""

from __future__ import annotations

import asyncio

from heron.engine import core_client
from heron.engine.args import EngineArgs
from heron.engine.async_llm import AsyncLLM
from heron.sampling_params import SamplingParams


def test_a_request_the_core_cannot_read_fails_alone(monkeypatch):
    encode = core_client.encode_request

    def unreadable_for_one(request):
        values = encode(request)
        if request.request_id.startswith("unreadable"):
            values[2] = ["not", "sampling", "parameters"]  # what decode_sampling_params cannot take
        return values

    monkeypatch.setattr(core_client, "encode_request", unreadable_for_one)
    config = EngineArgs(max_model_len=256, usage="serve").create_engine_config()

    async def scenario() -> None:
        llm = AsyncLLM(config)
        try:
            await llm.wait_until_ready(timeout=120)
            processor = llm.input_processor
            params = SamplingParams(max_tokens=4, temperature=0)
            refused = [out async for out in llm.generate(processor.process_prompt("hi"), params, "unreadable-1")]
            assert refused[-1].finished and refused[-1].outputs[0].finish_reason == "abort"
            served = [out async for out in llm.generate(processor.process_prompt("hi"), params, "fine-1")]
            assert served[-1].finished and len(served[-1].outputs[0].token_ids) == 4
            assert not llm.is_dead
        finally:
            llm.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 180))
