"""Data parallelism on one host (``heron serve --data-parallel-size N``): N
engine-core processes behind one API server, each request placed by the same
policy as ``heron router`` (``heron/routing``).

Every engine core publishes its KV-cache events on its own socket; this client
follows them into one block index per engine, hashes each prompt (it is
already tokenized here) and sends the request where its leading blocks are
cached unless that engine is much busier. Load is the requests under way per
engine, counted when one is sent. Outputs of all engines are merged into one
stream, with their scheduler statistics summed (the counters stay monotonic,
the gauges cover every engine), and the engines report ready as one.

It offers ``EngineCoreClient``'s methods, so ``AsyncLLM`` drives either.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import zmq.asyncio

from heron.config import EngineConfig
from heron.core.hashing import BlockHash, prompt_block_hashes
from heron.engine.args import EngineArgs
from heron.engine.core_client import EngineCoreClient, EngineCoreEndpoint, EngineCoreProcess, OwnedEngineCore
from heron.engine.cpu_slices import describe, rank_cpu_slices
from heron.engine.rank_events import (
    check_rank_endpoints,
    kv_events_of,
    rank_kv_events,
    with_kv_events,
    with_rank_kv_transfer,
)
from heron.engine.serialization import MessageKind, decode_outputs
from heron.request import EngineCoreRequest
from heron.routing.kv_index import KVBlockIndex
from heron.routing.kv_subscriber import KVEventSubscriber
from heron.routing.policies import ReplicaLoad, Router, RoutingPolicy
from heron.step_outputs import EngineCoreOutputs, SchedulerStats
from heron.tempdirs import make_private_dir, remove_private_dir

logger = logging.getLogger(__name__)

RESUBSCRIBE_DELAY_S = 1.0  # between a subscription that ended and the next (one failing at once never spins)


def start_engine_cores(
    engine: EngineConfig | EngineArgs, log_level: str = "INFO", num_clients: int = 1
) -> list[OwnedEngineCore]:
    """One engine core per data-parallel rank (local processes, or Ray actors
    with ``data_parallel_backend`` ray), each publishing its KV-cache events on
    its own socket (``rank_events.py``), each talking to ``num_clients`` API
    servers."""
    check_rank_endpoints(kv_events_of(engine), engine.data_parallel_size)
    if engine.data_parallel_backend == "ray":
        from heron.engine.ray_engines import start_ray_engine_cores

        return list(start_ray_engine_cores(engine, log_level, num_clients))
    size = engine.data_parallel_size
    if size == 1:
        return [EngineCoreProcess.start(engine, log_level, num_clients)]
    private_dir = make_private_dir("heron-dp-")
    # the private event sockets live as long as this (the API server's) process
    atexit.register(remove_private_dir, private_dir)
    processes: list[OwnedEngineCore] = []
    slices = rank_cpu_slices(size)
    if slices is not None:
        logger.info("engine cores on CPUs %s (OpenMP threads each as many; set OMP_NUM_THREADS to place them "
                    "yourself)", ", ".join(f"rank {rank}: {describe(cpus)}" for rank, cpus in enumerate(slices)))
    try:
        for rank in range(size):
            private = f"ipc://{os.path.join(private_dir, f'kv-events-{rank}')}"
            ranked = with_rank_kv_transfer(
                with_kv_events(engine, rank_kv_events(kv_events_of(engine), rank, private)), rank)
            processes.append(EngineCoreProcess.start(ranked, log_level, num_clients,
                                                     cpus=slices[rank] if slices is not None else None))
    except BaseException:  # a Ctrl-C between two starts: the ranks started so far must not outlive the caller
        for process in processes:
            process.kill()
        raise
    return processes


@dataclass
class _Engine:
    """One engine core as the routing policy sees it."""

    rank: int
    client: EngineCoreClient
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    index: KVBlockIndex = field(default_factory=KVBlockIndex)
    stats: SchedulerStats | None = None
    num_requests: int = 0

    @property
    def name(self) -> str:
        return str(self.rank)

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        return self.index.matched_blocks(block_hashes)


class DataParallelClient:
    def __init__(self, config: EngineConfig, started: Sequence[OwnedEngineCore | EngineCoreEndpoint],
                 policy: RoutingPolicy = "kv_aware") -> None:
        """``started``: the engine cores, owned by this client (processes) or by
        another process (endpoints: ``--api-server-count``)."""
        self.config = config
        self.engines = [_Engine(rank, EngineCoreClient(config, started=process),
                                ReplicaLoad(capacity=config.scheduler.max_num_seqs))
                        for rank, process in enumerate(started)]
        self.router = Router(policy)
        # engine request id -> its engine and the prefill blocks it brought there
        self._owner: dict[str, tuple[_Engine, int]] = {}
        self._queue: asyncio.Queue[tuple[MessageKind, Any]] = asyncio.Queue()
        self._readers: list[asyncio.Task[None]] = []
        self._subscriptions: list[asyncio.Task[None]] = []
        self._ready: dict[int, dict[str, Any]] = {}
        self._context = zmq.asyncio.Context()

    # ---- requests ----------------------------------------------------------------

    async def add_request(self, request: EngineCoreRequest) -> None:
        hashes = prompt_block_hashes(request.prompt_token_ids, self.config.cache.block_size, request.cache_salt)
        decision = self.router.choose(self.engines, hashes)
        engine = decision.replica
        assert isinstance(engine, _Engine)
        self._owner[request.request_id] = (engine, decision.uncached_blocks)
        engine.load.dispatch(decision.uncached_blocks)
        engine.index.expect(hashes)
        engine.num_requests += 1
        try:
            await engine.client.add_request(request)
        except BaseException:  # it never reached the engine: no output will come back to release it
            self._owner.pop(request.request_id, None)
            engine.index.forget_expected(hashes)  # nothing will be cached there for it
            engine.load.release(decision.uncached_blocks)
            engine.num_requests -= 1
            raise

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            owner = self._owner.get(request_id)
            if owner is not None:
                by_engine.setdefault(owner[0].rank, []).append(request_id)
        for rank, ids in by_engine.items():
            await self.engines[rank].client.abort_requests(ids)

    def requests_per_engine(self) -> list[int]:
        return [engine.num_requests for engine in self.engines]

    # ---- outputs -----------------------------------------------------------------

    async def receive(self) -> tuple[MessageKind, Any]:
        if not self._readers:
            self._readers = [asyncio.create_task(self._read(engine), name=f"heron-dp-output-{engine.rank}")
                             for engine in self.engines]
        return await self._queue.get()

    async def _read(self, engine: _Engine) -> None:
        """One engine's messages into the shared queue. A message it cannot read
        (a bug, a version skew) is that engine's failure, passed on as FAILED: a
        reader that ended in silence left every request of its engine waiting."""
        try:
            while True:
                kind, payload = await engine.client.receive()
                if kind == MessageKind.OUTPUTS:
                    await self._queue.put((kind, self._merge(engine, decode_outputs(payload))))
                elif kind == MessageKind.READY:
                    self._on_ready(engine, payload)
                elif kind in (MessageKind.FAILED, MessageKind.LOAD_FAILED):
                    await self._queue.put((kind, f"engine core {engine.rank}: {payload}"))
        except Exception as exc:
            logger.exception("engine core %d: reading its outputs failed", engine.rank)
            await self._queue.put((MessageKind.FAILED, f"engine core {engine.rank}: its outputs could not be read "
                                                       f"({exc!r})"))

    def _merge(self, engine: _Engine, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        for output in outputs.outputs:
            owner = self._owner.pop(output.request_id, None) if output.finished else None
            if owner is not None:
                engine.load.release(owner[1])
        if outputs.scheduler_stats is not None:
            engine.stats = stats = outputs.scheduler_stats
            # the engine's own count covers requests other API servers sent it
            engine.load.reported_running = stats.num_running_reqs
            engine.load.reported_waiting = stats.num_waiting_reqs
            engine.load.kv_cache_usage = stats.kv_cache_usage
            merged = _sum_stats([e.stats for e in self.engines if e.stats is not None], len(self.engines))
            merged.num_scheduled_tokens = stats.num_scheduled_tokens  # this step's: this engine's alone
            merged.earlier_step_tokens = stats.earlier_step_tokens
            outputs.scheduler_stats = merged
        return outputs

    def _on_ready(self, engine: _Engine, payload: dict[str, Any]) -> None:
        self._ready[engine.rank] = payload
        info = payload.get("kv_events")
        if info is not None:
            self._follow(engine, info)
        if len(self._ready) == len(self.engines):
            first = self._ready[0]
            # the private IPC events are this client's; an outside router follows the ranks' TCP ones
            publishes = self.config.kv_events.publishes
            kv_events = first.get("kv_events") if publishes else None
            merged = {
                **first,
                "kv_events": kv_events,
                "kv_events_ranks": [self._ready[rank].get("kv_events") for rank in sorted(self._ready)]
                if publishes else None,
                "num_kv_blocks": sum(p.get("num_kv_blocks", 0) for p in self._ready.values()),
                "pid": [self._ready[rank].get("pid") for rank in sorted(self._ready)],
                "data_parallel_size": len(self.engines),
            }
            self._queue.put_nowait((MessageKind.READY, merged))

    # ---- the rest of EngineCoreClient's face ----------------------------------------

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        results = await asyncio.gather(*(e.client.call_utility(method, *args, timeout=timeout) for e in self.engines))
        if all(isinstance(result, bool) for result in results):
            return all(results)
        return results

    def is_alive(self) -> bool:
        return all(engine.client.is_alive() for engine in self.engines)

    def hung_reason(self, heartbeat_timeout_s: float, step_timeout_s: float) -> str | None:
        """The first hung engine core's reason (one hung engine takes the server down, as a dead one does)."""
        for engine in self.engines:
            reason = engine.client.hung_reason(heartbeat_timeout_s, step_timeout_s)
            if reason is not None:
                return f"engine core {engine.rank}: {reason}"
        return None

    def _follow(self, engine: _Engine, info: dict[str, Any]) -> None:
        """Keep ``engine``'s index from its KV events; a subscription that ends
        other than by shutdown (it never should) starts again on a clean index,
        or placement would go on by what the engine held when it ended."""
        subscriber = KVEventSubscriber(self._context, info["endpoint"], info["replay_endpoint"],
                                       info.get("topic", ""), engine.index)
        task = asyncio.create_task(subscriber.run(), name=f"heron-dp-kv-{engine.rank}")
        self._subscriptions.append(task)

        def restart(ended: asyncio.Task[None]) -> None:
            self._subscriptions.remove(ended)
            if ended.cancelled() or self._context.closed:
                return
            logger.warning("engine %d's KV event subscription ended (%r): following it again in %g s",
                           engine.rank, ended.exception(), RESUBSCRIBE_DELAY_S)
            engine.index.reset()
            asyncio.get_running_loop().call_later(RESUBSCRIBE_DELAY_S, follow_again)

        def follow_again() -> None:
            if not self._context.closed:
                self._follow(engine, info)

        task.add_done_callback(restart)

    def could_not_load(self) -> bool:
        return any(engine.client.could_not_load() for engine in self.engines)

    def exit_reason(self) -> str:
        """Which engine core is gone, and how (one gone takes the server down)."""
        gone = next((e for e in self.engines if not e.client.is_alive()), self.engines[0])
        return f"engine core {gone.rank}: {gone.client.exit_reason()}"

    def fail_pending_calls(self, error: BaseException) -> None:
        for engine in self.engines:
            engine.client.fail_pending_calls(error)

    def shutdown(self, timeout: float = 5.0) -> None:
        for task in self._readers + self._subscriptions:
            task.cancel()
        for engine in self.engines:
            engine.client.shutdown(timeout)
        self._context.destroy(0)


def _sum_stats(all_stats: list[SchedulerStats], num_engines: int) -> SchedulerStats:
    """Every engine's statistics as one: counts add up, KV usage is the mean
    over all ``num_engines`` (one that has not reported yet has run nothing: it
    counts as empty, where leaving it out read N times the usage after a start)
    (a step's scheduled tokens are the reporting engine's: ``_merge``)."""
    total = SchedulerStats()
    for spec in fields(SchedulerStats):
        values = [getattr(stats, spec.name) for stats in all_stats]
        setattr(total, spec.name, sum(values))
    return replace(total, kv_cache_usage=total.kv_cache_usage / max(1, num_engines))
