"""The gateway state several API-server processes share (``--api-server-count``):
token buckets and waiting-request counts hold across processes, the table
gives way under too many keys, and the engine core's channels keep requests of
different API servers apart."""

import multiprocessing
import time

import pytest
import zmq

from heron.engine.core_channels import ClientAddresses, ClientChannels
from heron.engine.serialization import decode_outputs, unpack
from heron.entrypoints.openai.errors import APIError
from heron.entrypoints.openai.gateway import TokenBucketLimiter
from heron.entrypoints.openai.shared_gateway import SharedGatewayState, create_shared_gateway_file
from heron.step_outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


@pytest.fixture
def state_file(tmp_path):
    path = str(tmp_path / "gateway")
    create_shared_gateway_file(path, num_servers=2, bucket_slots=64)
    return path


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
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=_take_many, args=(state_file, index, 40, start, results)) for index in (0, 1)]
    for worker in workers:
        worker.start()
    start.set()
    taken = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(30)
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
