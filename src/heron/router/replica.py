"""The replicas behind a router: each one's health (a circuit breaker fed by
requests and periodic probes), its load, and its KV-cache index (kept by a
subscriber to its events, found through its ``GET /v1/kv_events``).

A replica whose breaker opens loses its index (its cache may be gone: it may
be restarting) and its event subscription; when a probe succeeds again it is
used again and re-subscribes, replaying what the replica still keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import zmq.asyncio

from heron.core.hashing import BlockHash
from heron.routing.health import BreakerState, CircuitBreaker, is_replica_failure
from heron.routing.kv_index import KVBlockIndex
from heron.routing.kv_subscriber import KVEventSubscriber
from heron.routing.policies import ReplicaLoad

logger = logging.getLogger(__name__)

T = TypeVar("T")

_METRIC = re.compile(r'^heron:(num_requests_running|num_requests_waiting|kv_cache_usage_perc)\{[^}]*\} ([0-9.eE+-]+)$')
# only these samples: a replica renders three gauges instead of every histogram (~30 KB)
_SUBSCRIBE_RETRY_S = 30.0  # after a refused /v1/kv_events (a rate limit, an error)
_LOAD_QUERY = [("name[]", f"heron:{name}") for name in ("num_requests_running", "num_requests_waiting",
                                                       "kv_cache_usage_perc")]


def _health_fields(health: bytes) -> dict[str, Any]:
    """A /health body's JSON object ({} when it is none: vLLM's empty body, or not JSON)."""
    try:
        body = json.loads(health) if health else None
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _takes_kv_transfers(health: dict[str, Any]) -> bool:
    """Whether a replica's /health says it pulls prefilled KV: a heron replica
    names its kv_role (None: no --kv-transfer-config); one that names none (vLLM's
    empty body) is taken at its word that it was set up as a decode server."""
    return "kv_role" not in health or health["kv_role"] in ("kv_consumer", "kv_both")


def _block_size(health: dict[str, Any]) -> int | None:
    """The KV block size a /health body names (None: none, as vLLM's)."""
    size = health.get("block_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _epoch(health: dict[str, Any]) -> str | None:
    """The KV events epoch a /health body names (None: none)."""
    epoch = health.get("kv_events_epoch")
    return epoch if isinstance(epoch, str) else None


@dataclass
class Replica:
    url: str  # http://host:port, no trailing slash
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    index: KVBlockIndex = field(default_factory=KVBlockIndex)
    subscriber: KVEventSubscriber | None = None
    subscription: asyncio.Task[None] | None = None
    subscribe_after: float = 0.0  # (monotonic) a refused /v1/kv_events is asked again only then
    # a replica of several data-parallel engines: the other ranks' caches (``index`` is rank 0's), each
    # followed on its own; the replica sends a prompt to the engine that holds most of it
    rank_indexes: list[KVBlockIndex] = field(default_factory=list)
    rank_subscriptions: list[asyncio.Task[None]] = field(default_factory=list)
    num_requests: int = 0
    # whether it pulls a prefill engine's KV: one that does not is sent the client's request as it came (a
    # kv_transfer_params it cannot take was a 400 naming a field the client never sent)
    takes_kv_transfers: bool = True
    block_size: int | None = None  # its KV blocks' tokens, as its /health names them (None: not named)
    # requests waiting on it (``unless_taken_out``): told when its breaker opens
    out_waiters: set[asyncio.Future[None]] = field(default_factory=set)
    answered: bool = False  # it has answered a probe or a request (a breaker starts closed on faith)

    @property
    def name(self) -> str:
        return self.url

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """The leading blocks its best-placed engine holds."""
        matched = self.index.matched_blocks(block_hashes)
        for index in self.rank_indexes:
            matched = max(matched, index.matched_blocks(block_hashes))
        return matched

    @property
    def cached_blocks(self) -> int:
        return len(self.index.blocks) + sum(len(index.blocks) for index in self.rank_indexes)

    def stop_subscription(self) -> None:
        if self.subscription is not None:
            self.subscription.cancel()
        for task in self.rank_subscriptions:
            task.cancel()
        self.subscription = self.subscriber = None
        self.rank_subscriptions, self.rank_indexes = [], []

    def unfollow(self) -> None:
        """Stop following its events and forget its cache (gone, or to be replayed afresh)."""
        self.stop_subscription()
        self.index.reset()


class TakenOut(Exception):
    """The replica's breaker opened (its probes failed: a hung host, a partition) while a request waited on it."""


async def unless_taken_out(replica: Replica, work: Awaitable[T]) -> T:
    """``work``'s result, or TakenOut as soon as ``replica``'s breaker opens
    (``work`` is then cancelled). A request waiting on a replica that stopped
    answering waited until its client gave up, though the router had taken the
    replica out and another one could serve it."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    replica.out_waiters.add(waiter)
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise TakenOut(f"{replica.url} was taken out (its circuit opened) before it answered")
        return task.result()
    finally:
        replica.out_waiters.discard(waiter)
        if not task.done():
            task.cancel()  # an upstream request closes its connection
            with contextlib.suppress(BaseException):
                await task


class ReplicaSet:
    """Probes every replica every ``probe_interval`` seconds: ``/health`` for the
    breaker, ``/metrics`` for the load it reports, ``/v1/kv_events`` to subscribe.

    ``discover``, if given, is asked for more replicas' URLs before each round
    (those registered on a Ray cluster): new ones join, and discovered ones no
    longer listed leave, with their index and subscription; the ``urls`` given
    at start always stay."""

    def __init__(self, urls: Sequence[str], headers: dict[str, str], probe_interval: float = 1.0,
                 probe_timeout: float = 2.0, discover: Callable[[], Awaitable[list[str]]] | None = None,
                 decodes: bool = True) -> None:
        """``decodes``: these replicas decode what ``--prefill`` replicas prefilled
        (whether each pulls prefilled KV matters, and is logged: a plain router
        logged for every replica that it pulled none)."""
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.decodes = decodes
        self.fixed = {replica.url for replica in self.replicas}
        self.discover = discover
        self.headers = headers
        self.probe_interval = probe_interval
        self.timeout = aiohttp.ClientTimeout(total=probe_timeout)
        self.context = zmq.asyncio.Context()
        # the replicas' (from /v1/kv_events; the first replica followed sets it); prompts are hashed in these
        # blocks, so a replica with other blocks never matches (it is warned about)
        self.block_size = 16
        self._block_size_known = False
        self._task: asyncio.Task[None] | None = None

    def usable(self, exclude: Sequence[Replica] = ()) -> list[Replica]:
        return [r for r in self.replicas if r.breaker.usable and r not in exclude]

    def record(self, replica: Replica, status: int | None, why: str = "") -> None:
        """A request's outcome (None: no response; ``why``: what went wrong, for
        the log). An opening breaker drops the index."""
        was_open = replica.breaker.state is BreakerState.OPEN
        replica.breaker.record(status)
        replica.answered = replica.answered or not is_replica_failure(status)
        if replica.breaker.state is BreakerState.OPEN and not was_open:
            logger.warning("replica %s is out (circuit open after %d failures%s)", replica.url,
                           replica.breaker.consecutive_failures, f"; the last: {why}" if why else "")
            replica.unfollow()
            for waiter in replica.out_waiters:  # requests waiting on it: another replica may serve them
                if not waiter.done():
                    waiter.set_result(None)

    async def start(self, session: aiohttp.ClientSession) -> None:
        await self._round(session)
        self._task = asyncio.create_task(self._probe_forever(session), name="heron-router-probes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        close = getattr(self.discover, "close", None)  # a discovery with a process of its own
        if close is not None:
            await close()
        for replica in self.replicas:
            replica.stop_subscription()
        self.context.destroy(0)

    async def _probe_forever(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            await self._round(session)

    async def _round(self, session: aiohttp.ClientSession) -> None:
        if self.discover is not None:
            try:
                self.set_discovered(await self.discover())
            except Exception as exc:  # noqa: BLE001 (keep the replicas we have; try again next round)
                logger.warning("replica discovery failed: %s", exc)
        replicas = list(self.replicas)
        outcomes = await asyncio.gather(*(self.probe(session, replica) for replica in replicas),
                                        return_exceptions=True)
        for replica, outcome in zip(replicas, outcomes, strict=True):
            if isinstance(outcome, Exception):  # a bug or a strange answer: the next round tries again
                logger.warning("probing %s failed: %r", replica.url, outcome)

    def set_discovered(self, urls: Sequence[str]) -> None:
        """The discovered replicas are now ``urls`` (those given at start stay)."""
        wanted = {url.rstrip("/") for url in urls} | self.fixed
        for replica in self.replicas:
            if replica.url not in wanted:
                logger.info("replica %s left (no longer registered)", replica.url)
                replica.stop_subscription()
        present = {replica.url for replica in self.replicas}
        self.replicas = [replica for replica in self.replicas if replica.url in wanted]
        for url in sorted(wanted - present):
            logger.info("replica %s joined", url)
            self.replicas.append(Replica(url))

    async def probe(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        if replica.breaker.state is BreakerState.OPEN and not replica.breaker.allows():
            return  # let it rest until it may be tried (then this probe is its half-open trial)
        why = ""
        try:
            # with the key: a replica started with --protect-metrics wants it on /health too
            async with session.get(f"{replica.url}/health", headers=self.headers, timeout=self.timeout) as response:
                status = response.status
                health = await response.read() if status == 200 else b""
            if status == 200:
                await self._follow(session, replica, health)
            else:
                why = f"/health answered {status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            status = None
            why = f"/health: {exc!r}"
        self.record(replica, status if status == 200 else None, why)  # a probe succeeds on 200 alone

    async def _follow(self, session: aiohttp.ClientSession, replica: Replica, health: bytes) -> None:
        """A healthy replica's load and KV events. An answer this router cannot
        read (not JSON, another shape) is logged and leaves the replica healthy:
        it used to escape the probe, which then recorded nothing (a half-open
        breaker never closed again)."""
        try:
            fields = _health_fields(health)
            takes = _takes_kv_transfers(fields)
            if takes != replica.takes_kv_transfers and self.decodes:
                logger.info("replica %s pulls %s", replica.url, "prefilled KV" if takes else
                            "no prefilled KV (started without --kv-transfer-config): it computes its prompts")
            replica.takes_kv_transfers = takes
            replica.block_size = _block_size(fields)
            self._follow_restarts(replica, _epoch(fields))
            await self._read_metrics(session, replica)
            # only a replica whose /health names its events' epoch publishes any; each ask of /v1/kv_events
            # takes a token of the replica's rate limit (the router asked every second, and a client sharing
            # its key got 429s at half its limit)
            wanted = replica.subscription is None and _epoch(fields) is not None
            if wanted and time.monotonic() >= replica.subscribe_after:
                await self._subscribe(session, replica)
        except (TimeoutError, aiohttp.ClientError, OSError):
            raise
        except Exception:
            logger.exception("following %s: an answer this router cannot read", replica.url)

    def _follow_restarts(self, replica: Replica, epoch: str | None) -> None:
        """Start following a replica's events again when a subscription (rank
        0's or another data-parallel rank's) ended (it never should) or the
        replica restarted: its events' epoch changed (its numbers start again
        from 0, which the old subscription would drop as seen), or it had one
        and /health names none (restarted without KV events: what it held is gone)."""
        subscriber = replica.subscriber
        subscriptions = [replica.subscription, *replica.rank_subscriptions] if replica.subscription else []
        ended = next((task for task in subscriptions if task.done()), None)
        if ended is not None:
            error = None if ended.cancelled() else ended.exception()
            logger.warning("the KV event subscription %r ended (%r): following %s again", ended.get_name(), error,
                           replica.url)
        elif subscriber is not None and subscriber.epoch is not None and epoch != subscriber.epoch:
            logger.info("replica %s restarted (KV events epoch %s -> %s): following it again", replica.url,
                        subscriber.epoch, epoch or "none, events off")
        else:
            return
        replica.unfollow()

    async def _read_metrics(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        async with session.get(f"{replica.url}/metrics", params=_LOAD_QUERY, headers=self.headers,
                               timeout=self.timeout) as response:
            if response.status != 200:
                return
            text = await response.text()
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match is None:
                continue
            name, value = match.group(1), float(match.group(2))
            if name == "num_requests_running":
                replica.load.reported_running = int(value)
            elif name == "num_requests_waiting":
                replica.load.reported_waiting = int(value)
            else:
                replica.load.kv_cache_usage = value

    def _note_block_size(self, replica: Replica, block_size: int) -> None:
        if not self._block_size_known:
            self.block_size, self._block_size_known = block_size, True
        elif block_size != self.block_size:
            logger.warning("replica %s stores KV in blocks of %d tokens, the replicas before it in %d: this "
                           "router hashes prompts in %d-token blocks, so it never finds %s's cached prefixes "
                           "(start every replica with the same --block-size)", replica.url, block_size,
                           self.block_size, self.block_size, replica.url)

    async def _subscribe(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        async with session.get(f"{replica.url}/v1/kv_events", headers=self.headers, timeout=self.timeout) as response:
            if response.status != 200:
                replica.subscribe_after = time.monotonic() + _SUBSCRIBE_RETRY_S
                return
            info = await response.json()
        if not isinstance(info, dict) or not info.get("enabled"):
            return
        endpoint, replay_endpoint = info.get("endpoint"), info.get("replay_endpoint")
        if not isinstance(endpoint, str) or not isinstance(replay_endpoint, str):
            logger.warning("%s/v1/kv_events names no endpoints: not following its events", replica.url)
            return
        self._note_block_size(replica, int(info.get("block_size", self.block_size)))
        replica.subscriber = KVEventSubscriber(self.context, endpoint, replay_endpoint, str(info.get("topic", "")),
                                               replica.index, epoch=info.get("epoch"))
        replica.subscription = asyncio.create_task(replica.subscriber.run(), name=f"kv-events {replica.url}")
        followed = [endpoint]
        ranks = info.get("ranks")
        for rank, rank_info in enumerate(ranks[1:] if isinstance(ranks, list) else [], start=1):
            if not isinstance(rank_info, dict) or not isinstance(rank_info.get("endpoint"), str):
                continue
            index = KVBlockIndex()
            subscriber = KVEventSubscriber(self.context, rank_info["endpoint"], str(rank_info["replay_endpoint"]),
                                           str(rank_info.get("topic", "")), index, epoch=rank_info.get("epoch"))
            replica.rank_indexes.append(index)
            replica.rank_subscriptions.append(
                asyncio.create_task(subscriber.run(), name=f"kv-events {replica.url} rank {rank}"))
            followed.append(rank_info["endpoint"])
        logger.info("following %s's KV-cache events at %s", replica.url, ", ".join(followed))
