"""A hung engine core (engine/liveness.py): one whose process still exists but
is stopped (SIGSTOP) or stuck in a step. It was never detected: /health said
ok and every request waited for ever. Here over stand-in engine-core processes
(tests/unit/fake_engine_core.py) that send heartbeats as the real one does;
the real engine core's heartbeat is tested in tests/model/test_engine_heartbeat.py
and a stopped one behind a live server in tests/e2e/test_dead_engine.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from heron.engine.async_llm import AsyncLLM, EngineDeadError
from heron.engine.input_processor import ProcessedPrompt
from heron.engine.liveness import HEARTBEAT_INTERVAL_S, EngineLiveness
from heron.sampling_params import SamplingParams
from tests.unit.test_dp_client_faults import config, fake_engines  # noqa: F401 (a fixture)


def test_silence_past_the_heartbeat_timeout_is_a_hang():
    liveness = EngineLiveness()
    assert liveness.hung_reason(1.0, 1.0, now=100.0) is None  # never heard from: loading, watched by its exit
    liveness.heartbeat({"step_s": 0.0}, now=100.0)
    assert liveness.hung_reason(3.0, 0.0, now=102.9) is None
    reason = liveness.hung_reason(3.0, 0.0, now=103.5)
    assert reason is not None and "sent nothing for 4 s" in reason and "--engine-heartbeat-timeout 3" in reason
    assert liveness.hung_reason(0.0, 0.0, now=1e6) is None  # 0: never
    liveness.heard(now=103.4)  # any message counts
    assert liveness.hung_reason(3.0, 0.0, now=103.5) is None


def test_a_step_running_past_the_step_timeout_is_a_hang():
    liveness = EngineLiveness()
    liveness.heartbeat({"step_s": 4.0}, now=10.0)  # a step began at 6.0
    assert liveness.hung_reason(30.0, 0.0, now=10.5) is None  # no step timeout
    assert liveness.hung_reason(30.0, 5.0, now=10.5) is None
    reason = liveness.hung_reason(30.0, 5.0, now=11.5)  # 5.5 s into the step, between heartbeats
    assert reason is not None and "has run for 6 s" in reason and "--engine-step-timeout 5" in reason
    liveness.heartbeat({"step_s": 0.0}, now=11.6)  # it ended
    assert liveness.hung_reason(30.0, 5.0, now=20.0) is None
    liveness.heartbeat({"bad": "payload"}, now=21.0)  # an unreadable heartbeat still says it runs
    assert liveness.hung_reason(30.0, 5.0, now=40.0) is None


async def _first_output_or_error(llm: AsyncLLM, request_id: str, timeout: float) -> BaseException | None:
    stream = llm.generate(ProcessedPrompt("hi", [1, 2, 3]), SamplingParams(max_tokens=4), request_id)
    try:
        await asyncio.wait_for(anext(stream), timeout)
    except (EngineDeadError, TimeoutError) as exc:
        return exc
    finally:
        await stream.aclose()
    return None


@pytest.mark.parametrize("num_engines", [1, 2])
def test_a_stopped_engine_core_is_marked_dead_and_one_that_beats_is_not(fake_engines, num_engines):  # noqa: F811
    processes, endpoints = fake_engines(num_engines)

    async def scenario() -> None:
        llm = AsyncLLM(config(num_engines), started=endpoints, heartbeat_timeout_s=2.5)
        try:
            await llm.wait_until_ready(timeout=30)
            # beating, it lives past the timeout though it never answers the request
            assert isinstance(await _first_output_or_error(llm, "held", 4.0), TimeoutError)
            assert not llm.is_dead
            os.kill(processes[-1].pid, signal.SIGSTOP)
            stopped = time.monotonic()
            error = await _first_output_or_error(llm, "waits", 10.0)
            assert isinstance(error, EngineDeadError), error
            assert time.monotonic() - stopped >= 2.5 - HEARTBEAT_INTERVAL_S  # silent since its last beat
            assert llm.is_dead and "sent nothing" in (llm.dead_reason or "")
            if num_engines > 1:
                assert (llm.dead_reason or "").startswith(f"engine core {num_engines - 1}: ")
        finally:
            llm.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("step_timeout_s", [0.0, 2.0])
def test_a_step_that_never_ends_is_marked_dead_only_with_a_step_timeout(fake_engines, step_timeout_s):  # noqa: F811
    _, endpoints = fake_engines(2)

    async def scenario() -> str | None:
        llm = AsyncLLM(config(2), started=endpoints, heartbeat_timeout_s=30.0, step_timeout_s=step_timeout_s)
        try:
            await llm.wait_until_ready(timeout=30)
            error = await _first_output_or_error(llm, "stuck", 4.5)
            assert isinstance(error, TimeoutError if step_timeout_s == 0 else EngineDeadError), error
            return llm.dead_reason
        finally:
            llm.shutdown()

    reason = asyncio.run(scenario())
    if step_timeout_s == 0:  # the default: never
        assert reason is None
    else:
        assert reason is not None and "is stuck" in reason and "--engine-step-timeout 2" in reason


def test_an_engine_core_ignores_sigint_from_its_first_instruction():
    """A Ctrl-C while the engine core was still importing (before it set SIGINT
    aside) printed a KeyboardInterrupt traceback from its imports (found by the
    lifecycle review): it starts with SIGINT ignored, and this process's own
    handler is back once it has started."""
    import signal
    import subprocess
    import sys

    from heron.engine.core_client import _sigint_ignored_by_children

    before = signal.getsignal(signal.SIGINT)
    with _sigint_ignored_by_children():
        child = subprocess.run(
            [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"],
            capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "True"
    assert signal.getsignal(signal.SIGINT) is before
