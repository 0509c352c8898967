"""Async scheduling, driven without a model: a fake runner reports each step's
tokens one step late (after the next step was scheduled), as the engine core does
when it overlaps the host with the device."""

from __future__ import annotations

from heron.config import CacheConfig, SchedulerConfig
from heron.core.scheduler import Scheduler
from heron.core.scheduler_output import SchedulerOutput
from heron.request import RequestStatus
from heron.sampling_params import SamplingParams
from heron.step_outputs import ModelRunnerOutput
from tests.helpers import make_request


def make_async_scheduler(num_blocks: int = 64, block_size: int = 16, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, policy="fcfs",
                        enable_chunked_prefill=True),
        CacheConfig(block_size=block_size, enable_prefix_caching=True),
        num_kv_blocks=num_blocks,
        max_model_len=1024,
        async_scheduling=True,
    )


class LaggingRunner:
    """Samples ``next_token(request)`` for every request a step samples for, and
    reports a step's tokens only after the following step was scheduled."""

    def __init__(self, scheduler: Scheduler, next_token=lambda request, step: 7) -> None:
        self.scheduler = scheduler
        self.next_token = next_token
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.steps: list[SchedulerOutput] = []
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str | None] = {}
        self.on_schedule = lambda output: None  # called before the previous step is reported

    def step(self) -> None:
        scheduler = self.scheduler
        before = {rid: r.num_output_placeholders for rid, r in scheduler.requests.items()}
        output = scheduler.schedule()
        self.steps.append(output)
        request_ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in request_ids:
            request = scheduler.requests[request_id]
            samples = request.num_output_placeholders > before.get(request_id, 0)
            sampled.append([self.next_token(request, len(self.steps))] if samples else [])
        self.on_schedule(output)
        previous, self.in_flight = self.in_flight, (output, ModelRunnerOutput(request_ids, sampled))
        if previous is not None:
            self._report(*previous)
        scheduler.kv_cache_manager.check_integrity()

    def drain(self) -> None:
        if self.in_flight is not None:
            self._report(*self.in_flight)
            self.in_flight = None

    def _report(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for core_output in self.scheduler.update_from_output(output, runner_output).outputs:
            self.outputs.setdefault(core_output.request_id, []).extend(core_output.new_token_ids)
            if core_output.finish_reason is not None:
                self.finish_reasons[core_output.request_id] = core_output.finish_reason

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        self.drain()
        assert not self.scheduler.has_unfinished_requests()


def test_placeholders_keep_decoding_without_waiting_and_respect_max_tokens():
    scheduler = make_async_scheduler()
    request = make_request(20, max_tokens=4)
    scheduler.add_request(request)
    runner = LaggingRunner(scheduler)
    runner.step()  # prefill: samples token 1, not yet reported
    assert request.num_output_placeholders == 1 and request.num_output_tokens == 0
    runner.step()  # decodes the in-flight token without knowing it
    assert runner.steps[-1].num_scheduled_tokens == {request.request_id: 1}
    assert request.num_output_tokens == 1 and request.num_output_placeholders == 1
    runner.run()
    assert runner.outputs[request.request_id] == [7] * 4
    assert runner.finish_reasons[request.request_id] == "length"
    # exactly one prefill and three decodes: max_tokens is seen ahead, no wasted step
    steps = [s for s in runner.steps if request.request_id in s.num_scheduled_tokens]
    assert len(steps) == 4
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_a_stop_seen_late_discards_the_extra_step():
    scheduler = make_async_scheduler()
    stopping = make_request(10, max_tokens=50)
    other = make_request(12, token_offset=300, max_tokens=6)
    scheduler.add_request(stopping)
    scheduler.add_request(other)
    eos = next(iter(stopping.eos_token_ids))
    # the stopping request samples EOS as its third token
    runner = LaggingRunner(scheduler, lambda request, step: eos if request is stopping and request.num_output_tokens
                           + request.num_output_placeholders == 3 else 7)
    runner.run()
    assert runner.outputs[stopping.request_id] == [7, 7, eos]
    assert runner.finish_reasons[stopping.request_id] == "stop"
    assert runner.outputs[other.request_id] == [7] * 6
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_a_request_preempted_with_a_token_in_flight_waits_for_it():
    # 6 blocks of 4 tokens: two requests of 9 prompt tokens outgrow the pool while decoding
    scheduler = make_async_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=32)
    first, second = make_request(9, max_tokens=8), make_request(9, token_offset=400, max_tokens=8)
    scheduler.add_request(first)
    scheduler.add_request(second)
    runner = LaggingRunner(scheduler)
    victims_in_flight = []

    def check(output: SchedulerOutput) -> None:
        for request_id in output.preempted_req_ids:
            victim = scheduler.requests[request_id]
            victims_in_flight.append(victim.num_output_placeholders)
            # its recompute waits for the token in flight: admitting it now would lose it
            assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0

    runner.on_schedule = check
    runner.run()
    assert scheduler.num_preemptions > 0 and victims_in_flight and all(n == 1 for n in victims_in_flight)
    assert runner.outputs[first.request_id] == [7] * 8
    assert runner.outputs[second.request_id] == [7] * 8
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_requests_that_need_their_previous_token_turn_overlap_off():
    scheduler = make_async_scheduler()
    plain = make_request(8, max_tokens=2)
    scheduler.add_request(plain)
    assert scheduler.can_schedule_ahead()
    penalised = make_request(8, token_offset=100, max_tokens=2)
    penalised.sampling_params = SamplingParams(max_tokens=2, presence_penalty=0.5)
    scheduler.add_request(penalised)
    assert not scheduler.can_schedule_ahead()
    scheduler.finish_requests([penalised.request_id], RequestStatus.FINISHED_ABORTED)
    assert scheduler.can_schedule_ahead()
