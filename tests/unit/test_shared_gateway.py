"""The gateway state several API-server processes share (``--api-server-count``):
token buckets and waiting-request counts hold across processes, the table
gives way under too many keys, and the engine core's channels keep requests of
different API servers apart."""

import fcntl
import multiprocessing
import os
import time

import pytest
import zmq

from heron.engine.core_channels import ClientAddresses, ClientChannels
from heron.engine.serialization import decode_outputs, unpack
from heron.entrypoints.openai.errors import APIError
from heron.entrypoints.openai.gateway import TokenBucketLimiter
from heron.entrypoints.openai.serving_common import ServingContext, start_generation
from heron.entrypoints.openai.shared_gateway import SharedGatewayState, create_shared_gateway_file
from heron.sampling_params import SamplingParams
from heron.step_outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


@pytest.fixture
def state_file(tmp_path):
    path = str(tmp_path / "gateway")
    create_shared_gateway_file(path, num_servers=2, bucket_slots=64)
    return path


def in_two_processes(target, state_file: str, *args) -> list:
    """``target(state_file, index, *args, start, results)`` in two processes (API
    servers 0 and 1) started together; what each put in ``results``."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=target, args=(state_file, index, *args, start, results)) for index in (0, 1)]
    for worker in workers:
        worker.start()
    start.set()
    outcomes = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(30)
    return outcomes


def _take_many(path: str, index: int, attempts: int, start, results) -> None:
    state = SharedGatewayState(path, index)
    limiter = TokenBucketLimiter(rate=0.001, burst=50, shared=state)
    start.wait()
    taken = 0
    for _ in range(attempts):
        try:
            limiter.acquire("client-key")
            taken += 1
        except APIError:
            pass
    results.put(taken)
    state.close()


def test_two_processes_share_one_bucket_per_key(state_file):
    taken = in_two_processes(_take_many, state_file, 40)
    # 80 attempts against one burst of 50: a limiter per process would let 80 through
    assert sum(taken) == 50, taken
    assert all(count > 0 for count in taken), taken


def test_buckets_refill_per_key_and_report_the_wait(state_file):
    state = SharedGatewayState(state_file, 0)
    assert [state.take_token("a", rate=2.0, burst=2, now=100.0) for _ in range(3)] == [0.0, 0.0, 0.5]
    assert state.take_token("b", rate=2.0, burst=2, now=100.0) == 0.0  # another key, its own bucket
    other = SharedGatewayState(state_file, 1)  # a second process's view of the same file
    assert other.take_token("a", rate=2.0, burst=2, now=100.25) == pytest.approx(0.25)
    assert other.take_token("a", rate=2.0, burst=2, now=100.5) == 0.0  # refilled at 2/s
    state.close()
    other.close()


def test_a_clock_read_before_the_lock_does_not_set_a_bucket_back(state_file):
    """A process that read its clock, then waited for the lock, wrote its older
    time over a newer one: the span between was refilled twice."""
    state = SharedGatewayState(state_file, 0)
    assert state.take_token("a", rate=1.0, burst=1, now=10.0) == 0.0
    assert state.take_token("a", rate=1.0, burst=1, now=11.0) == 0.0  # refilled by 11
    assert state.take_token("a", rate=1.0, burst=1, now=10.5) > 0  # the late one: nothing left
    assert state.take_token("a", rate=1.0, burst=1, now=11.5) == pytest.approx(0.5)  # 11.5 - 11, not - 10.5
    state.close()


def test_a_full_table_gives_way_to_the_bucket_used_longest_ago(state_file):
    state = SharedGatewayState(state_file, 0)
    for number in range(500):  # far more keys than the 64 slots
        assert state.take_token(f"key-{number}", rate=1.0, burst=1, now=float(number + 1)) == 0.0
    # the newest keys keep their buckets: an immediate second request waits
    assert state.take_token("key-499", rate=1.0, burst=1, now=500.0) > 0
    state.close()


def test_waiting_counts_add_up_over_api_servers(state_file):
    first, second = SharedGatewayState(state_file, 0), SharedGatewayState(state_file, 1)
    first.publish_waiting(3)
    second.publish_waiting(4)
    assert first.total_waiting() == second.total_waiting() == 7
    first.publish_waiting(0)
    assert second.total_waiting() == 4
    with pytest.raises(ValueError, match="index 2"):
        SharedGatewayState(state_file, 2)
    first.close()
    second.close()


def test_each_api_server_says_when_it_is_ready_and_the_others_see_it(state_file):
    first, second = SharedGatewayState(state_file, 0), SharedGatewayState(state_file, 1)
    assert not first.is_ready(0) and not first.is_ready(1)
    second.publish_ready()
    assert first.is_ready(1) and not second.is_ready(0)  # its own flag alone
    first.publish_ready()
    assert second.is_ready(0)
    first.publish_waiting(5)  # the flags and the counts are apart
    assert second.total_waiting() == 5 and second.is_ready(0) and second.is_ready(1)
    first.close()
    second.close()


def _admit_many(path: str, index: int, limit: int, seconds: float, start, results) -> None:
    """An API server's admissions for ``seconds``: a check, the work before the
    request is counted (tokenizing, adding it), the count published; every third
    round one of its requests gets its first token and stops waiting."""
    state = SharedGatewayState(path, index)
    own = admitted = most_seen = round_number = 0
    start.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        round_number += 1
        with state.admitting() as waiting:
            most_seen = max(most_seen, waiting)
            if waiting < limit:
                time.sleep(0.0005)
                own += 1
                admitted += 1
                state.publish_waiting(own)
        if own and round_number % 3 == 2:
            own -= 1
            state.publish_waiting(own)
    results.put((admitted, most_seen, round_number))
    state.close()


def test_admissions_in_two_processes_never_overshoot_the_bound(state_file):
    """A check and the admission it allows are one step for the whole server:
    with the check alone shared, two processes that both see one free place
    both take it, and the next check sees more waiting than the bound."""
    outcomes = in_two_processes(_admit_many, state_file, 4, 0.5)
    # both contended for the places (which one gets in is up to the scheduler: on a loaded machine one process
    # could hold all four places the whole time, and "each admitted some" failed with the bound kept)
    assert all(rounds > 0 for _, _, rounds in outcomes) and sum(admitted for admitted, _, _ in outcomes) > 0, outcomes
    assert max(most_seen for _, most_seen, _ in outcomes) <= 4, outcomes


def test_not_a_state_file_is_refused(tmp_path):
    path = tmp_path / "other"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not a heron gateway state file"):
        SharedGatewayState(str(path), 0)


def test_real_clock_limiter_over_shared_state(state_file):
    limiter = TokenBucketLimiter(rate=1000.0, burst=1, shared=SharedGatewayState(state_file, 0))
    limiter.acquire("k")
    time.sleep(0.01)
    limiter.acquire("k")  # refilled on the shared monotonic clock


def test_engine_core_channels_split_outputs_by_api_server():


    context = zmq.Context()

    clients = [ClientAddresses(f"inproc://in-{i}", f"inproc://out-{i}") for i in range(3)]
    channels = ClientChannels.connected(context, clients)
    assert channels.tag(2, "cmpl-1:x") == "2:cmpl-1:x"
    stats = SchedulerStats(num_running_reqs=2)
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("0:a:b", [5]), EngineCoreOutput("2:c", [6])],
                                scheduler_stats=stats)

    split = {client: decode_outputs(unpack(message)[1]) for client, message in channels.split(outputs)}
    assert sorted(split) == [0, 1, 2]  # every API server gets the step's statistics
    assert [o.request_id for o in split[0].outputs] == ["a:b"]  # untagged, the rest of the id kept
    assert split[1].outputs == [] and split[1].scheduler_stats.num_running_reqs == 2
    assert [o.request_id for o in split[2].outputs] == ["c"]
    single = ClientChannels.connected(context, clients[:1])
    assert single.tag(0, "x") == "x"  # one API server: ids pass unchanged
    channels.close()
    single.close()
    context.term()


class _CountingEngine:
    """What start_generation needs of AsyncLLM: adding a request counts it as
    waiting at once and publishes the count (as AsyncLLM.generate does)."""

    def __init__(self, state: SharedGatewayState, lock_path: str) -> None:
        self.num_waiting_requests = 0
        self.state = state
        self.lock_path = lock_path
        self.added_under_lock: list[bool] = []

    def generate(self, prompt, params, request_id, **_):
        self.added_under_lock.append(_held_by_someone(self.lock_path))
        self.num_waiting_requests += 1
        self.state.publish_waiting(self.num_waiting_requests)
        return iter(())

    def discard(self, request_id: str) -> None:
        raise AssertionError("nothing fails here")


def _held_by_someone(path: str) -> bool:
    fd = os.open(path, os.O_RDWR)  # a second open file: flock conflicts even within one process
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def test_requests_are_added_under_the_check_that_admitted_them(state_file):
    """start_generation checks the server-wide bound and adds the request in one
    step under the state file's lock; the other API server's waiting requests
    count against it."""
    state, other = SharedGatewayState(state_file, 0), SharedGatewayState(state_file, 1)
    engine = _CountingEngine(state, state_file)
    ctx = ServingContext(engine=engine, served_model_name="m", max_model_len=64,  # type: ignore[arg-type]
                         max_waiting_requests=3, shared=state)
    other.publish_waiting(1)
    for number in range(2):
        start_generation(ctx, [object()], [SamplingParams()], f"r{number}", 0, None)  # type: ignore[list-item]
    assert engine.added_under_lock == [True, True]
    assert other.total_waiting() == 3
    with pytest.raises(APIError) as refused:
        start_generation(ctx, [object()], [SamplingParams()], "r2", 0, None)  # type: ignore[list-item]
    assert refused.value.status_code == 429 and "3 requests are already waiting" in refused.value.message
    other.publish_waiting(0)  # the other server's request got its first token
    start_generation(ctx, [object()], [SamplingParams()], "r3", 0, None)  # type: ignore[list-item]
    assert engine.num_waiting_requests == 3
    state.close()
    other.close()
