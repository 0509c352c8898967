"""The router's view of a replica's cache when its KV events go wrong: a replay
that never comes, a replay longer than a socket's queue, a batch this router
cannot decode, a subscription that ended, a replica restarted under the same
address (its events numbered from 0 again). In each case the index never
claims a block the replica reported removed, and the router keeps following
the replica's events. Real publishers and ZMQ sockets on loopback; the
replica's HTTP side is a small aiohttp app."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from heron.config import KVEventsConfig
from heron.core.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from heron.engine.kv_events_publisher import ZmqEventPublisher
from heron.router.replica import ReplicaSet
from heron.routing import kv_subscriber
from heron.routing.health import BreakerState
from heron.routing.kv_index import KVBlockIndex
from heron.routing.kv_subscriber import KVEventSubscriber
from tests.unit.test_kv_events import with_publisher

X, Y, Z = b"x" * 32, b"y" * 32, b"z" * 32


def stored(*hashes: bytes) -> bytes:
    return encode_batch(KVEventBatch(0.0, [BlockStored(list(hashes), None, [1] * len(hashes), 1)]))


def removed(*hashes: bytes) -> bytes:
    return encode_batch(KVEventBatch(0.0, [BlockRemoved(list(hashes))]))


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_replay_that_never_comes_clears_what_the_missed_batches_removed(monkeypatch):
    monkeypatch.setattr(kv_subscriber, "REPLAY_TIMEOUT_MS", 200)

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        publisher = context.socket(zmq.PUB)
        port = publisher.bind_to_random_port("tcp://127.0.0.1")
        mute = context.socket(zmq.ROUTER)  # the replay socket: takes requests, never answers
        replay_port = mute.bind_to_random_port("tcp://127.0.0.1")
        index = KVBlockIndex()
        index.apply(0, KVEventBatch(0.0, [BlockStored([X], None, [1], 1)]))
        subscriber = KVEventSubscriber(context, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "",
                                       index)
        task = asyncio.create_task(subscriber.run())
        try:
            # batch 1 (X removed) is lost on the way; batch 2 arrives (resent until the subscription is live)
            for _ in range(100):
                await publisher.send_multipart([b"", (2).to_bytes(8, "big"), stored(Y)])
                await asyncio.sleep(0.05)
                if index.last_seq == 2:
                    break
            assert index.last_seq == 2 and Y in index.blocks
            assert X not in index.blocks and subscriber.num_lost_batches == 1
        finally:
            task.cancel()
            await asyncio.sleep(0)
            context.destroy(0)

    asyncio.run(scenario())


def test_a_replay_of_more_batches_than_a_socket_queues_arrives_whole():
    count = 3000  # ZMQ queues 1,000 messages a socket by default

    def history(publisher: ZmqEventPublisher) -> None:
        for i in range(count):  # the replica holds one block at a time
            evicted = [BlockRemoved([(i - 1).to_bytes(32, "big")])] if i else []
            publisher.publish([*evicted, BlockStored([i.to_bytes(32, "big")], None, [1], 1)])

    async def test(publisher: ZmqEventPublisher, subscriber: KVEventSubscriber, index: KVBlockIndex) -> None:
        await until(lambda: not publisher._pending)  # noqa: SLF001 (sent)
        await asyncio.sleep(0.1)
        assert await subscriber.replay(0)
        assert index.last_seq == count - 1 and index.blocks == {(count - 1).to_bytes(32, "big")}
        assert subscriber.num_lost_batches == 0

    with_publisher(test, history)


def test_a_batch_this_router_cannot_read_costs_the_index_not_the_subscription():
    async def test(publisher: ZmqEventPublisher, subscriber: KVEventSubscriber, index: KVBlockIndex) -> None:
        task = asyncio.create_task(subscriber.run())
        try:
            publisher.publish([BlockStored([X], None, [1], 1)])
            await until(lambda: X in index.blocks)
            publisher._enqueue(msgpack.packb([0.0, [["BlockStoredV2", [Z]]], None]))  # another version's kind
            publisher.publish([BlockStored([Y], None, [1], 1)])
            await until(lambda: Y in index.blocks)
            assert not task.done() and X not in index.blocks  # unknown what batch 1 did: X no longer claimed
            assert index.last_seq == 2 and subscriber.num_lost_batches == 1
            # hashes an index cannot hold (a list is unhashable: the set's update raised and ended the task)
            publisher._enqueue(msgpack.packb([0.0, [["BlockStored", [[1, 2]], None, [1], 1, None, None]], None]))
            publisher.publish([BlockStored([Z], None, [1], 1)])
            await until(lambda: Z in index.blocks)
            assert not task.done() and Y not in index.blocks and subscriber.num_lost_batches == 2
        finally:
            task.cancel()

    with_publisher(test)


def test_a_message_of_the_wrong_shape_is_skipped_not_the_end_of_the_subscription():
    """Two or four frames where the publisher sends three: unpacking them raised
    and ended the task (for a data-parallel rank's subscription, for good)."""
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        publisher = context.socket(zmq.PUB)
        port = publisher.bind_to_random_port("tcp://127.0.0.1")
        replay = context.socket(zmq.ROUTER)
        replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
        index = KVBlockIndex()
        subscriber = KVEventSubscriber(context, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "",
                                       index)

        async def answer_replays() -> None:
            while True:
                frames = await replay.recv_multipart()
                await replay.send_multipart([frames[0], b"", (-1).to_bytes(8, "big", signed=True), b""])

        replays = asyncio.create_task(answer_replays())
        task = asyncio.create_task(subscriber.run())
        try:
            await until(lambda: subscriber.num_replays == 1)
            await asyncio.sleep(0.2)  # the SUB socket has joined
            for seq, frames in enumerate([[b"", (0).to_bytes(8, "big")], [b"", (1).to_bytes(8, "big"), b"x", b"y"]]):
                await publisher.send_multipart(frames)
                await publisher.send_multipart([b"", seq.to_bytes(8, "big"), stored(bytes([seq]) * 32)])
            await until(lambda: index.blocks == {bytes([0]) * 32, bytes([1]) * 32})
            assert not task.done()
        finally:
            task.cancel()
            replays.cancel()
            await asyncio.gather(task, replays, return_exceptions=True)
            context.destroy(0)

    asyncio.run(scenario())


class EventfulReplica:
    """A replica's HTTP side over a real publisher; ``restart()`` swaps in a new
    publisher (a new epoch, its numbers from 0) as a restarted server would."""

    def __init__(self) -> None:
        self.publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*"))
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.kv_events_answer: dict | None = None
        self.events_on = True  # False: restarted without KV events (no epoch in /health)
        self.kv_events_asked = 0
        self.kv_events_status = 200

    def info(self) -> dict:
        return {"enabled": True, "endpoint": self.publisher.endpoint, "topic": "", "block_size": 16,
                "replay_endpoint": self.publisher.replay_endpoint, "epoch": self.publisher.epoch}

    async def start(self) -> None:
        async def health(_: web.Request) -> web.Response:
            epoch = {"kv_events_epoch": self.publisher.epoch} if self.events_on else {}
            return web.json_response({"status": "ok", **epoch})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="")

        async def kv_events(_: web.Request) -> web.Response:
            self.kv_events_asked += 1
            if self.kv_events_status != 200:
                return web.json_response({"error": {"message": "slow down"}}, status=self.kv_events_status)
            answer = self.kv_events_answer or self.info()
            return web.json_response(answer if self.events_on else {"enabled": False, "block_size": 16})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/kv_events", kv_events)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]:d}"  # type: ignore[union-attr]

    def restart(self) -> None:
        self.publisher.shutdown()
        self.publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*"))

    async def stop(self) -> None:
        self.publisher.shutdown()
        assert self.runner is not None
        await self.runner.cleanup()


def run_replica_set(test, events_on: bool = True) -> None:
    async def scenario() -> None:
        replica = EventfulReplica()
        replica.events_on = events_on
        await replica.start()
        async with aiohttp.ClientSession() as session:
            replicas = ReplicaSet([replica.url], {}, probe_interval=0.05)
            await replicas.start(session)
            try:
                await test(replica, replicas)
            finally:
                await replicas.stop()
                await replica.stop()

    asyncio.run(scenario())


def test_a_replica_restarted_at_the_same_address_is_followed_again():
    async def test(replica: EventfulReplica, replicas: ReplicaSet) -> None:
        index = replicas.replicas[0].index
        for i in range(20):
            replica.publisher.publish([BlockStored([bytes([i]) * 32], None, [1], 1)])
        replica.publisher.publish([BlockStored([X], None, [1], 1)])
        await until(lambda: X in index.blocks and index.last_seq == 20)
        replica.restart()  # an empty cache; batches numbered from 0 again
        replica.publisher.publish([BlockStored([Y], None, [1], 1)])
        await until(lambda: Y in index.blocks)
        assert X not in index.blocks and index.last_seq == 0

    run_replica_set(test)


def test_a_replica_restarted_without_kv_events_is_no_longer_credited_with_its_blocks():
    """Its /health names no epoch any more: the old subscription kept listening
    to a publisher that was gone, and the index kept its blocks for good."""
    async def test(replica: EventfulReplica, replicas: ReplicaSet) -> None:
        tracked = replicas.replicas[0]
        await until(lambda: tracked.subscription is not None)
        replica.publisher.publish([BlockStored([X], None, [1], 1)])
        await until(lambda: X in tracked.index.blocks)
        replica.events_on = False
        await until(lambda: tracked.subscription is None)
        assert tracked.matched_blocks([X]) == 0 and tracked.breaker.allows()

    run_replica_set(test)


def test_a_subscription_that_ended_is_started_again_and_the_probes_outlive_odd_answers():
    async def test(replica: EventfulReplica, replicas: ReplicaSet) -> None:
        tracked = replicas.replicas[0]
        await until(lambda: tracked.subscription is not None)
        tracked.subscription.cancel()  # as if it had died
        replica.publisher.publish([BlockStored([X], None, [1], 1)])
        await until(lambda: X in tracked.index.blocks)  # followed again by a later probe
        replica.kv_events_answer = {"enabled": True}  # names no endpoints
        tracked.stop_subscription()
        await asyncio.sleep(0.3)  # several rounds
        assert replicas._task is not None and not replicas._task.done()
        assert tracked.subscription is None and tracked.breaker.allows()
        # an answer that breaks the subscription's set-up (a block size of null) while the breaker waits for
        # its half-open trial: the probe used to end on the error and record nothing, leaving it half-open
        replica.kv_events_answer = {"enabled": True, "endpoint": "tcp://127.0.0.1:9", "block_size": None,
                                    "replay_endpoint": "tcp://127.0.0.1:9"}
        for _ in range(3):
            replicas.record(tracked, None)  # open
        await until(lambda: tracked.breaker.state is BreakerState.CLOSED, 15)
        assert tracked.subscription is None

    run_replica_set(test)


def test_every_data_parallel_engine_of_a_replica_is_followed():
    """A replica of --data-parallel-size N published rank 0's events alone: a
    prompt cached on another engine never matched at the router."""
    second = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*"))

    async def test(replica: EventfulReplica, replicas: ReplicaSet) -> None:
        rank_1 = {"endpoint": second.endpoint, "replay_endpoint": second.replay_endpoint, "topic": "",
                  "epoch": second.epoch}
        replica.kv_events_answer = {**replica.info(), "ranks": [replica.info(), rank_1]}
        tracked = replicas.replicas[0]
        tracked.unfollow()  # subscribed before the answer changed: again, now with both ranks
        await until(lambda: len(tracked.rank_indexes) == 1)
        replica.publisher.publish([BlockStored([X], None, [1], 1)])
        second.publish([BlockStored([Y], None, [1], 1), BlockStored([Z], Y, [1], 1)])
        await until(lambda: tracked.matched_blocks([Y, Z]) == 2 and tracked.matched_blocks([X]) == 1)
        assert tracked.matched_blocks([X, Z]) == 1 and tracked.cached_blocks == 3  # no engine holds X then Z
        # another rank's subscription that ended is started again too (only rank 0's was), its index afresh
        ended = tracked.rank_subscriptions[0]
        ended.cancel()
        await until(lambda: tracked.rank_subscriptions[:1] not in ([], [ended]))
        second.publish([BlockRemoved([Z])])
        await until(lambda: tracked.matched_blocks([Y, Z]) == 1)  # replayed, and followed since
        for _ in range(3):
            replicas.record(tracked, None)  # out: every rank's index goes with it
        assert tracked.matched_blocks([Y]) == 0 and not tracked.rank_subscriptions

    try:
        run_replica_set(test)
    finally:
        second.shutdown()


@pytest.mark.parametrize("body", [b"", b"ok", b"[1]", b'{"kv_events_epoch": 3}'])
def test_a_health_body_without_an_epoch_is_no_restart(body):
    from heron.router.replica import _epoch, _health_fields

    assert _epoch(_health_fields(body)) is None


def test_kv_events_are_asked_for_only_where_health_names_them_and_not_again_at_once_after_a_refusal():
    """The router asked /v1/kv_events at every probe of a replica without events
    (each ask a token of the replica's rate limit: a client sharing the key got
    429s at half its limit), and again at every probe after a 429."""
    async def test(replica: EventfulReplica, replicas: ReplicaSet) -> None:
        await asyncio.sleep(0.5)  # about ten probes
        assert replica.kv_events_asked == 0
        replica.events_on, replica.kv_events_status = True, 429
        await until(lambda: replica.kv_events_asked >= 1)
        await asyncio.sleep(0.5)
        assert replica.kv_events_asked == 1  # not again until the retry time

    run_replica_set(test, events_on=False)
