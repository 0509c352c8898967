"""KV-cache events: the block pool reports every change of its prefix-cache map,
the events survive the wire, an index rebuilt from them equals the pool's map,
and the ZMQ publisher numbers its batches and replays missed ones."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import zmq

from heron.config import KVEventsConfig
from heron.core.hashing import hash_block_tokens
from heron.core.kv_cache_manager import KVCacheManager
from heron.core.kv_disk_layout import DiskTierLayout
from heron.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from heron.engine.kv_events_publisher import END_OF_REPLAY, ZmqEventPublisher, connectable
from heron.routing.kv_index import KVBlockIndex
from tests.helpers import make_request


def prompt_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """What a router computes from a prompt on its own."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


def test_stores_carry_hashes_parent_and_tokens_a_router_can_recompute():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_kv_events=True)
    request = make_request(10, token_ids=list(range(100, 110)))
    manager.allocate_slots(request, 10)
    [stored] = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == prompt_hashes(list(range(100, 110)), 4)  # 2 full blocks
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size) == (None, list(range(100, 108)), 4)
    assert manager.take_events() == []  # taken: nothing twice


def test_a_later_block_names_its_parent_and_duplicates_are_not_stored_twice():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_kv_events=True)
    first = make_request(8, token_ids=list(range(8)))
    manager.allocate_slots(first, 4)
    first.num_computed_tokens = 4
    manager.allocate_slots(first, 4)  # the second block fills
    events = manager.take_events()
    hashes = prompt_hashes(list(range(8)), 4)
    assert [e.block_hashes for e in events] == [[hashes[0]], [hashes[1]]]
    assert events[1].parent_block_hash == hashes[0] and events[1].token_ids == [4, 5, 6, 7]
    twin = make_request(8, token_ids=list(range(8)))  # computed without a hit: same hashes, not canonical
    manager.allocate_slots(twin, 8)
    assert manager.take_events() == []


@pytest.mark.parametrize("num_offload_blocks", [0, 6])
def test_an_index_replaying_the_events_equals_the_prefix_cache_under_churn(num_offload_blocks):
    """Random requests through a small pool (evictions, shared prefixes, resets):
    after every step the router-side index holds exactly the pool's hashes, and
    with an offload tier the tier's too (what the engine serves without recomputing)."""
    rng = random.Random(0)
    manager = KVCacheManager(num_blocks=12, block_size=4, enable_kv_events=True, num_offload_blocks=num_offload_blocks)
    index = KVBlockIndex()
    live = []
    kinds = set()
    for step in range(300):
        if live and (rng.random() < 0.45 or manager.num_free_blocks < 4):
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            prefix = rng.choice([0, 1000, 2000])
            request = make_request(rng.randint(1, 14), token_offset=prefix)
            hits, num_hit = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if manager.allocate_slots(request, num_new, new_computed_blocks=hits, num_new_computed_tokens=num_hit):
                live.append(request)
        if step % 97 == 96:  # everyone finishes, then the cache is reset
            while live:
                manager.free(live.pop())
            assert manager.reset_prefix_cache()
        manager.take_transfers()  # the step's copies
        events = manager.take_events()
        kinds.update(type(event) for event in events)
        index.apply(step, KVEventBatch(0.0, events))
        tier = set(manager.offload) if manager.offload is not None else set()
        assert index.blocks == set(manager.block_pool.cached_blocks) | tier, step
        manager.check_integrity()
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}  # the churn exercised every kind
    if num_offload_blocks:
        assert manager.offload is not None and manager.offload.stats.loaded > 0 and manager.offload.stats.evicted > 0


def compute_and_free(manager: KVCacheManager, num_tokens: int, token_offset: int) -> None:
    """A request of ``num_tokens`` computed whole, then finished."""
    request = make_request(num_tokens, token_offset=token_offset)
    manager.get_computed_blocks(request)
    manager.allocate_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    manager.free(request)


def test_a_disk_block_that_fails_to_load_is_reported_removed(tmp_path):
    """Evicted from the pool but held on disk, a block is not reported removed;
    when its load then fails (its file deleted by another replica, or corrupt
    and deleted by the loader) the tier forgets it, and the events must say so:
    they used to keep it, and a router kept sending its prefix here."""
    layout = DiskTierLayout.create(tmp_path, b"f" * 16, 64)
    manager = KVCacheManager(num_blocks=3, block_size=4, enable_kv_events=True, disk_layout=layout,
                             disk_max_bytes=1 << 20)
    index = KVBlockIndex()
    compute_and_free(manager, 9, 0)
    for offset in (100, 200, 300):  # push the first prompt's blocks out of the pool
        compute_and_free(manager, 9, offset)
    again = make_request(9, token_offset=0)
    found, _ = manager.get_computed_blocks(again)
    assert found.offloaded and manager.start_load(again, found)
    manager.take_transfers()
    manager.finish_load(again, list(found.offloaded))  # the worker could not read one of them
    manager.free(again)
    index.apply(0, KVEventBatch(0.0, manager.take_events()))
    assert manager.disk is not None
    assert index.blocks == set(manager.block_pool.cached_blocks) | set(manager.disk._held)
    assert not index.blocks & set(found.offloaded)


@pytest.mark.parametrize("failed_at", [0, 1, None])
def test_disk_blocks_count_loaded_only_when_the_request_keeps_them(tmp_path, failed_at):
    """Blocks after a failed one are computed again: they counted as loaded
    (heron:kv_offload_loaded_blocks_total) though they were thrown away."""
    layout = DiskTierLayout.create(tmp_path, b"f" * 16, 64)
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_kv_events=True, disk_layout=layout,
                             disk_max_bytes=1 << 20)
    compute_and_free(manager, 13, 0)  # three full blocks
    manager.take_transfers()
    compute_and_free(manager, 13, 100)  # pushes them out of the pool
    again = make_request(13, token_offset=0)
    found, _ = manager.get_computed_blocks(again)
    assert len(found.offloaded) == 3 and manager.start_load(again, found)
    failed = [] if failed_at is None else [found.offloaded[failed_at]]
    kept_tokens = manager.finish_load(again, failed)
    assert manager.disk is not None
    assert manager.disk.stats.loaded == (3 if failed_at is None else failed_at) == kept_tokens // 4
    assert manager.disk.stats.load_failures == len(failed)
    manager.free(again)


def test_events_round_trip_the_wire_format():
    batch = KVEventBatch(
        12.5,
        [BlockStored([b"a" * 32, b"b" * 32], None, [1, 2, 3, 4], 2), BlockRemoved([b"c" * 32]), AllBlocksCleared()],
        data_parallel_rank=1,
    )
    assert decode_batch(encode_batch(batch)) == batch
    with pytest.raises(ValueError, match="malformed KV event batch"):
        decode_batch(b"\x93\x01")


def test_the_config_takes_vllms_keys_and_rejects_others():
    config = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"})
    assert config.publishes and config.publisher == "zmq"
    assert not KVEventsConfig.from_dict(None).publishes
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "port": 1})
    with pytest.raises(ValueError, match="ZMQ address"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "localhost:5557"})
    # vLLM's bounds (a vLLM config was refused for naming them)
    bounded = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "hwm": 10, "max_queue_size": 5})
    assert (bounded.hwm, bounded.max_queue_size) == (10, 5)
    for key, value in (("hwm", -1), ("max_queue_size", 0), ("buffer_steps", True)):
        with pytest.raises(ValueError, match=f"kv_events_config.{key} must be an integer"):
            KVEventsConfig.from_dict({"enable_kv_cache_events": True, key: value})


def replayed_numbers(publisher: ZmqEventPublisher, context: zmq.Context, start: int = 0) -> list[int]:
    """The sequence numbers a replay from ``start`` brings."""
    replay = context.socket(zmq.DEALER)
    replay.connect(publisher.replay_endpoint)
    replay.send_multipart([b"", start.to_bytes(8, "big")])
    numbers = []
    while True:
        assert replay.poll(5000), "the replay socket did not answer"
        _, seq, _ = replay.recv_multipart()
        if seq == END_OF_REPLAY:
            return numbers
        numbers.append(int.from_bytes(seq, "big"))


class HeldSocket:
    """A PUB socket whose sends wait for ``go`` (a publishing thread that fell behind)."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket, self.go, self.waiting = socket, threading.Event(), threading.Event()

    def send_multipart(self, frames: list[bytes]) -> None:
        self.waiting.set()
        self.go.wait(10)
        self.socket.send_multipart(frames)

    def close(self, linger: int) -> None:
        self.socket.close(linger)


def test_batches_past_the_queue_bound_are_dropped_as_a_gap_where_they_fell():
    """The steps' queue had no bound. Past max_queue_size a batch is dropped and
    its number skipped at its place in the order (a gap counted elsewhere would
    put later batches under the dropped ones' numbers, and a subscriber would
    rebuild at the wrong place and keep a removed block)."""
    publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", max_queue_size=2))
    held = HeldSocket(publisher._pub)  # noqa: SLF001
    publisher._pub = held  # type: ignore[assignment]  # noqa: SLF001
    context = zmq.Context()
    try:
        stored = [BlockStored([b"h" * 32], None, [1, 2], 2)]
        publisher.publish(stored)  # 0: taken by the thread, which waits to send it
        assert held.waiting.wait(5)
        for _ in range(4):  # 1 and 2 queued, 3 and 4 dropped
            publisher.publish(stored)
        held.go.set()
        for expected in ([0, 1, 2], [0, 1, 2, 5]):
            deadline = time.monotonic() + 5
            while (numbers := replayed_numbers(publisher, context)) != expected and time.monotonic() < deadline:
                time.sleep(0.05)
            assert numbers == expected
            publisher.publish(stored)  # 5, once the thread has caught up
    finally:
        held.go.set()
        context.destroy(0)
        publisher.shutdown()


def test_a_peer_that_never_reads_its_replays_holds_at_most_two():
    """Each replay request queued a copy of the whole buffer for the peer, with no
    bound: one that asked again and again without reading grew the engine by the
    buffer's size each time (53 MB a request with the default buffer of
    10,000 steps in a review). Past two whole replays a peer's answers are dropped."""
    steps = 2000
    publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", buffer_steps=steps))
    context = zmq.Context()
    try:
        hashes = [bytes([i % 256]) * 32 for i in range(150)]  # ~5 KB a batch
        for _ in range(steps):
            publisher.publish([BlockStored(hashes, None, list(range(300)), 2)])
        assert replayed_numbers(publisher, context) == list(range(steps))  # one reader gets a whole replay
        peer = context.socket(zmq.DEALER)
        peer.setsockopt(zmq.RCVHWM, 1)
        peer.setsockopt(zmq.RCVBUF, 4096)
        peer.connect(publisher.replay_endpoint)
        requests = 30
        for _ in range(requests):
            peer.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(3)  # the publisher answers every request while the peer reads nothing
        received = 0
        while peer.poll(1000):
            peer.recv_multipart()
            received += 1
        assert 0 < received < 10 * (steps + 1), received  # 30 whole replays before
        assert replayed_numbers(publisher, context) == list(range(steps))  # others are served as before
    finally:
        context.destroy(0)
        publisher.shutdown()


def test_the_publisher_numbers_batches_and_replays_what_a_late_subscriber_missed():
    publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", topic="kv"))
    context = zmq.Context()
    try:
        first = [BlockStored([b"h" * 32], None, [1, 2], 2)]
        publisher.publish(first)
        publisher.publish([])  # an empty step sends nothing
        publisher.publish([BlockRemoved([b"h" * 32])])
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
        subscriber.connect(publisher.endpoint)
        replay = context.socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(5000), "the replay socket did not answer"
            _, seq, payload = replay.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            replayed.append((int.from_bytes(seq, "big"), decode_batch(payload).events))
        assert replayed == [(0, first), (1, [BlockRemoved([b"h" * 32])])]
        for _ in range(50):  # the slow-joiner: publish until the subscription is live
            publisher.publish([AllBlocksCleared()])
            if subscriber.poll(100):
                break
        live = []
        while not live or live[-1][1] != [AllBlocksCleared()]:
            assert subscriber.poll(5000), "no live batch arrived"
            topic, seq, payload = subscriber.recv_multipart()
            assert topic == b"kv"
            live.append((int.from_bytes(seq, "big"), decode_batch(payload).events))
        numbers = [seq for seq, _ in live]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and numbers[-1] >= 2
    finally:
        context.destroy(0)
        publisher.shutdown()


def test_a_wildcard_bind_is_reported_as_the_address_clients_dial():
    assert connectable("tcp://0.0.0.0:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert connectable("tcp://127.0.0.1:5557", "10.0.0.2") == "tcp://127.0.0.1:5557"


def with_publisher(test, before=lambda publisher: None) -> None:
    """``test(publisher, subscriber, index)`` (a coroutine) against a real publisher
    (``before`` publishes first), the router's subscriber made but not running."""
    import asyncio

    import zmq.asyncio

    from heron.routing.kv_subscriber import KVEventSubscriber

    publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*"))
    before(publisher)

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        index = KVBlockIndex()
        try:
            await test(publisher, KVEventSubscriber(context, publisher.endpoint, publisher.replay_endpoint, "", index),
                       index)
        finally:
            await asyncio.sleep(0)
            context.destroy(0)

    try:
        asyncio.run(scenario())
    finally:
        publisher.shutdown()


def test_a_subscriber_joining_late_or_missing_batches_rebuilds_the_replicas_cache():
    """The router's subscriber replays what it missed: its index equals the
    pool's prefix cache after joining late, and after a lost live batch."""
    import asyncio

    manager = KVCacheManager(num_blocks=32, block_size=4, enable_kv_events=True)

    def step(publisher: ZmqEventPublisher, offset: int, length: int = 12) -> None:
        request = make_request(length, token_offset=offset)
        manager.allocate_slots(request, length)
        manager.free(request)
        publisher.publish(manager.take_events())

    def history(publisher: ZmqEventPublisher) -> None:
        for offset in range(0, 40, 8):  # before the router existed
            step(publisher, offset)

    async def test(publisher, subscriber, index) -> None:
        async def caught_up() -> None:
            while index.blocks != set(manager.block_pool.cached_blocks):
                await asyncio.sleep(0.02)

        task = asyncio.create_task(subscriber.run())
        try:
            await asyncio.wait_for(caught_up(), 5)  # joined late: the replay brought the history
            task.cancel()  # the router loses its connection...
            for offset in range(100, 180, 8):  # ...while the replica evicts and stores (missed batches)
                step(publisher, offset)
            assert index.blocks != set(manager.block_pool.cached_blocks)
            task = asyncio.create_task(subscriber.run())
            await asyncio.wait_for(caught_up(), 5)
            for attempt in range(20):  # and live batches apply on top (once the subscription is live)
                step(publisher, 300 + 8 * attempt)
                try:
                    await asyncio.wait_for(caught_up(), 0.5)
                    break
                except TimeoutError:
                    continue
            assert index.blocks == set(manager.block_pool.cached_blocks)
            assert subscriber.num_replays >= 2 and subscriber.num_lost_batches == 0
        finally:
            task.cancel()

    with_publisher(test, history)


def test_each_data_parallel_rank_publishes_on_its_own_socket():
    from heron.engine.rank_events import rank_kv_events

    user = KVEventsConfig(True, "zmq", "tcp://*:5557", replay_endpoint="tcp://*:5600")
    ranked = rank_kv_events(user, 1, "ipc:///d/kv-events-1")
    assert (ranked.endpoint, ranked.replay_endpoint) == ("tcp://*:5558", "tcp://*:5601")
    assert rank_kv_events(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*"), 1, "x").endpoint == "tcp://127.0.0.1:*"
    private = rank_kv_events(KVEventsConfig(), 0, "ipc:///d/kv-events-0")  # the user asked for none
    assert private.publishes and private.endpoint == "ipc:///d/kv-events-0"
    # a Ray node: the user's wildcard host becomes the node's address (the API server dials it)
    on_node = rank_kv_events(user, 1, "unused", host="10.0.0.7")
    assert (on_node.endpoint, on_node.replay_endpoint) == ("tcp://10.0.0.7:5558", "tcp://10.0.0.7:5601")
    # and a loopback one (README's example): it stayed on the node's loopback, out of other machines' reach
    loopback = KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", replay_endpoint="tcp://localhost:5600")
    on_node = rank_kv_events(loopback, 1, "unused", host="10.0.0.7")
    assert (on_node.endpoint, on_node.replay_endpoint) == ("tcp://10.0.0.7:*", "tcp://10.0.0.7:5601")
    ipv6 = rank_kv_events(KVEventsConfig(True, "zmq", "tcp://[::1]:5557"), 1, "unused", host="fd00::7")
    assert ipv6.endpoint == "tcp://[fd00::7]:5558"


def test_ranks_whose_ports_would_meet_are_refused_before_anything_starts():
    """Rank r binds the events port + r and the replay port + r: under two ranks
    5557 and 5558 gave rank 1's events rank 0's replay port, and whichever rank
    bound second died on "Address already in use"."""
    from heron.engine.args import EngineArgs
    from heron.engine.dp_client import start_engine_cores
    from heron.engine.rank_events import check_rank_endpoints

    adjacent = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    with pytest.raises(ValueError, match="rank 1's endpoint would be tcp://\\*:5558, which is rank 0's "
                                         "replay_endpoint.*at least 2 apart"):
        start_engine_cores(EngineArgs(data_parallel_size=2, kv_events_config=adjacent))
    check_rank_endpoints(KVEventsConfig.from_dict(adjacent), 1)  # one rank: nothing to meet
    apart = KVEventsConfig(True, "zmq", "tcp://*:5557", replay_endpoint="tcp://*:5600")
    check_rank_endpoints(apart, 8)
    with pytest.raises(ValueError, match="rank 43's endpoint would be tcp://\\*:5600"):
        check_rank_endpoints(apart, 44)
    check_rank_endpoints(KVEventsConfig(True, "zmq", "tcp://*:*", replay_endpoint="tcp://*:*"), 4)


@pytest.mark.parametrize("endpoint, error", [
    ("tcp://127.0.0.1:99999", "must be \\* or 0-65535"),  # bound a port 99999 wrapped to, silently
    ("tcp://127.0.0.1:x", "must be \\* or 0-65535"),
    ("inproc://events", "must be a ZMQ address"),  # the publisher's own context: no one could connect
])
def test_an_events_endpoint_no_one_could_reach_is_refused(endpoint, error):
    with pytest.raises(ValueError, match=f"kv_events_config.endpoint.*{error}"):
        KVEventsConfig(True, "zmq", endpoint)


def test_a_replay_port_in_use_is_named_in_the_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", replay_endpoint=f"tcp://127.0.0.1:{port}")
        with pytest.raises(ValueError, match=f"cannot bind 'tcp://127.0.0.1:{port}'"):
            ZmqEventPublisher(config)


def test_each_rank_serves_prefill_blocks_on_its_own_port_and_a_reachable_host():
    from heron.config import KVTransferConfig
    from heron.engine.args import EngineArgs
    from heron.engine.rank_events import with_rank_kv_transfer

    args = EngineArgs(kv_transfer_config={"kv_role": "kv_producer", "kv_port": 7100})
    ranked = with_rank_kv_transfer(args, 2, host="10.0.0.5")
    assert isinstance(ranked, EngineArgs)
    config = KVTransferConfig.from_dict(ranked.kv_transfer_config)
    assert config is not None and (config.kv_port, config.kv_ip, config.kv_role) == (7102, "10.0.0.5", "kv_producer")
    any_port = EngineArgs(kv_transfer_config={"kv_role": "kv_producer"})
    assert with_rank_kv_transfer(any_port, 3) is any_port  # a free port each, on loopback
    assert with_rank_kv_transfer(EngineArgs(), 1).kv_transfer_config is None
