"""The one scheduling rule, driven without a model: a fake runner samples token 7
for every request that reached the end of its tokens."""

from __future__ import annotations

from heron.config import CacheConfig, SchedulerConfig
from heron.core.scheduler import Scheduler
from heron.core.scheduler_output import SchedulerOutput
from heron.request import Request, RequestStatus
from heron.step_outputs import EngineCoreOutputs, ModelRunnerOutput
from tests.helpers import make_request


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    max_model_len: int = 1024,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,  # type: ignore[arg-type]
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
    )


def step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    output = scheduler.schedule()
    request_ids = list(output.num_scheduled_tokens)
    sampled = []
    for request_id in request_ids:
        request = scheduler.requests[request_id]
        sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
    result = scheduler.update_from_output(output, ModelRunnerOutput(request_ids, sampled))
    scheduler.kv_cache_manager.check_integrity()
    return output, result


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def test_prefill_is_chunked_and_decode_shares_the_step():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    a, b = make_request(50, max_tokens=5), make_request(10, token_offset=100, max_tokens=5)
    add(scheduler, a, b)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {a.request_id: 32}
    assert [r.request_id for r in out.scheduled_new_reqs] == [a.request_id]
    out, _ = step(scheduler)
    # running first (the rest of a's prompt), then the waiting request
    assert out.num_scheduled_tokens == {a.request_id: 18, b.request_id: 10}
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 1}
    assert out.scheduled_cached_reqs.request_ids == [a.request_id, b.request_id]
    assert out.scheduled_cached_reqs.num_computed_tokens == [50, 10]


def test_without_chunked_prefill_a_long_prompt_waits_for_a_big_enough_budget():
    scheduler = make_scheduler(max_num_batched_tokens=40, enable_chunked_prefill=False)
    short, long = make_request(30), make_request(20, token_offset=100)
    add(scheduler, short, long)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {short.request_id: 30}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {short.request_id: 1, long.request_id: 20}


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(4, token_offset=10 * i) for i in range(3)]
    add(scheduler, *requests)
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == [requests[0].request_id, requests[1].request_id]
    assert len(scheduler.waiting) == 1


def test_stop_on_eos_stop_token_and_max_tokens():
    scheduler = make_scheduler()
    eos = make_request(4, max_tokens=10)
    stop_id = make_request(4, token_offset=50, max_tokens=10, stop_token_ids=[7], eos_token_ids=(99,))
    length = make_request(4, token_offset=90, max_tokens=3, eos_token_ids=(99,))
    ignore = make_request(4, token_offset=130, max_tokens=3, ignore_eos=True)
    add(scheduler, eos, stop_id, length, ignore)
    _, result = step(scheduler, token=2)  # 2 is the EOS id
    finished = {o.request_id: (o.finish_reason, o.stop_reason) for o in result.outputs if o.finished}
    assert finished == {eos.request_id: ("stop", None)}
    _, result = step(scheduler, token=7)
    finished = {o.request_id: (o.finish_reason, o.stop_reason) for o in result.outputs if o.finished}
    assert finished == {stop_id.request_id: ("stop", 7)}
    _, result = step(scheduler, token=2)
    finished = {o.request_id: o.finish_reason for o in result.outputs if o.finished}
    assert finished == {length.request_id: "length", ignore.request_id: "length"}
    assert ignore.output_token_ids == [2, 7, 2]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_min_tokens_defers_eos():
    scheduler = make_scheduler()
    request = make_request(4, max_tokens=10, min_tokens=2)
    add(scheduler, request)
    _, result = step(scheduler, token=2)
    assert not result.outputs[0].finished
    _, result = step(scheduler, token=2)
    assert result.outputs[0].finish_reason == "stop" and request.num_output_tokens == 2


def test_max_model_len_caps_generation():
    scheduler = make_scheduler(max_model_len=8)
    request = make_request(6, max_tokens=100)
    add(scheduler, request)
    step(scheduler)
    _, result = step(scheduler)
    assert result.outputs[0].finish_reason == "length" and request.num_tokens == 8


def test_preemption_frees_the_latest_request_and_it_resumes_by_recompute():
    # 4 blocks of 4 tokens: two 8-token prompts take 2 blocks each; the first
    # decode that crosses a block boundary must preempt the later request.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    first = make_request(8, max_tokens=4)
    second = make_request(8, token_offset=100, max_tokens=4)
    add(scheduler, first, second)
    step(scheduler)  # both prefilled, each has 9 tokens now (8 + 1 sampled)
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    out, _ = step(scheduler)  # first needs a 3rd block -> second is preempted
    assert out.preempted_req_ids == {second.request_id}
    assert out.num_scheduled_tokens == {first.request_id: 1}
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1 and scheduler.waiting.peek() is second
    # the runner must forget it; it did not finish
    assert second.request_id in out.forgotten_req_ids and second.request_id not in out.finished_req_ids
    while first.request_id in scheduler.requests:
        step(scheduler)
    # second resumes: prompt + its sampled token are recomputed (from the prefix cache)
    out, _ = step(scheduler)
    assert [r.request_id for r in out.scheduled_new_reqs] == [second.request_id]
    new = out.scheduled_new_reqs[0]
    assert new.token_ids == second.all_token_ids[: len(new.token_ids)] and len(new.token_ids) == 9
    assert new.num_computed_tokens + out.num_scheduled_tokens[second.request_id] == 9
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert second.num_output_tokens == 4


def test_prefix_cache_stats_count_each_admitted_request_once():
    """A request waiting for room was looked up, and counted, again at every
    step (queries 10,849 for 465 prompt tokens on a server), and a preempted
    one's recompute counted as prefix hits: the hit rate followed the queue."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    first = make_request(8, max_tokens=4)
    second = make_request(8, token_offset=100, max_tokens=4)
    third = make_request(8, token_offset=200, max_tokens=2)  # waits for room while the others run
    add(scheduler, first, second, third)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert second.num_preemptions == 1 and third.num_output_tokens == 2
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 24, 0)


def test_priority_policy_orders_waiting_and_preempts_the_least_important():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, policy="priority", max_num_seqs=2)
    low = make_request(7, priority=5, max_tokens=4)
    high = make_request(7, token_offset=100, priority=0, max_tokens=4)
    mid = make_request(3, token_offset=200, priority=1, max_tokens=4)
    add(scheduler, low, high, mid)
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == [high.request_id, mid.request_id]
    scheduler.finish_requests([mid.request_id], RequestStatus.FINISHED_ABORTED)
    step(scheduler)  # low admitted: pool now full
    out, _ = step(scheduler)  # high needs a block: low (priority 5) is the victim
    assert out.preempted_req_ids == {low.request_id}


def test_preempting_a_request_already_granted_tokens_takes_them_back():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=16, policy="priority")
    low = make_request(6, priority=9, max_tokens=8)
    add(scheduler, low)
    step(scheduler)  # low: 2 blocks, 7 tokens
    high = make_request(12, token_offset=100, priority=0, max_tokens=8)
    add(scheduler, high)
    step(scheduler)  # high: 3 blocks (pool full), 13 tokens; low: 8 tokens
    out, _ = step(scheduler)
    # low is served first (no new block needed); high then needs a 4th block and
    # low, the least important, is preempted: its grant this step is withdrawn
    assert out.preempted_req_ids == {low.request_id}
    assert out.num_scheduled_tokens == {high.request_id: 1}
    assert out.scheduled_cached_reqs.request_ids == [high.request_id]
    assert out.total_num_scheduled_tokens == 1
    assert low.num_computed_tokens == 0 and high.num_computed_tokens == 13


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_request(20), make_request(20, token_offset=100)
    add(scheduler, running, waiting)
    step(scheduler)
    aborted = scheduler.finish_requests(
        [running.request_id, waiting.request_id, "unknown"], RequestStatus.FINISHED_ABORTED
    )
    assert aborted == [running, waiting]
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    assert not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    assert out.is_empty and running.request_id in out.finished_req_ids
    scheduler.kv_cache_manager.check_integrity()


def test_prefix_cache_hit_skips_computed_tokens():
    scheduler = make_scheduler(block_size=4)
    first = make_request(10, max_tokens=2)
    add(scheduler, first)
    step(scheduler)
    second = make_request(10, max_tokens=2)  # same prompt
    add(scheduler, second)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens[second.request_id] == 2  # 8 of 10 tokens cached
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert second.num_cached_tokens == 8
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    add(scheduler, make_request(4, request_id="same"))
    try:
        add(scheduler, make_request(4, request_id="same"))
    except ValueError as exc:
        assert "already in use" in str(exc)
    else:
        raise AssertionError("duplicate id accepted")



def test_priority_preemption_of_a_request_with_its_last_token_in_flight():
    """Async scheduling, priority policy: the victim (lower priority, admitted
    first) was passed over this step, its last token in flight, so it had no
    grant to give back; preempting it raised KeyError and stopped the engine."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, policy="priority"),
                          CacheConfig(block_size=4, enable_prefix_caching=True), num_kv_blocks=3,
                          max_model_len=1024, async_scheduling=True)
    first = make_request(3, max_tokens=2, priority=1)
    second = make_request(8, token_offset=100, max_tokens=8, priority=0)
    scheduler.add_request(first)
    step1 = scheduler.schedule()
    scheduler.add_request(second)
    scheduler.schedule()  # the pool is full now
    scheduler.update_from_output(step1, ModelRunnerOutput(list(step1.num_scheduled_tokens), [[7]]))
    step3 = scheduler.schedule()  # the second needs a block: the first is preempted
    assert first.request_id in step3.preempted_req_ids and second.request_id in step3.num_scheduled_tokens
    assert step3.total_num_scheduled_tokens <= 64


def test_priority_ties_preempt_the_latest_admitted():
    """An n > 1 request's samples share priority and arrival time: the one admitted
    last gives way, as under FCFS (the earliest used to)."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, policy="priority", enable_prefix_caching=False)
    first = make_request(7, request_id="sample-0", max_tokens=20, arrival_time=5.0)
    second = make_request(7, request_id="sample-1", max_tokens=20, arrival_time=5.0)
    scheduler.add_request(first)
    scheduler.add_request(second)
    preempted: set[str] = set()
    for _ in range(4):
        output, _ = step(scheduler)
        preempted |= set(output.preempted_req_ids)
    assert preempted == {"sample-1"}


def test_draft_slots_stop_at_the_model_length():
    """Draft-model speculation reserves slots for its drafts, never past the
    model's length: a pool that holds exactly one request of that length (what
    the sizing check accepts) used to see the request preempt itself at 29 of
    32 tokens and never fit again."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          CacheConfig(block_size=16, enable_prefix_caching=True), num_kv_blocks=2,
                          max_model_len=32, num_lookahead_tokens=4)
    request = make_request(20, max_tokens=12)
    scheduler.add_request(request)
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        output, _ = step(scheduler)
        assert not output.preempted_req_ids
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and request.num_tokens == 32
