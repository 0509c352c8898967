"""The scheduler's KV-connector half (a mixin of ``core/scheduler.py``):
requests whose prefix is loaded in the background, and leases on the blocks
of finished prefills that a decode engine will pull.

Loading: a request whose prefix continues on disk (``core/kv_disk_index.py``)
or was prefilled by another engine (``kv_transfer_params`` with
``do_remote_prefill``) leaves the waiting queue for ``loading`` in state
``WAITING_FOR_KV`` while the worker fills its blocks; other requests keep
running. When the worker reports the load (``update_kv_loads``) the request
goes back to the head of the queue with the loaded prefix computed, holding
its blocks; a failed load is recomputed from the first failure or fails the
request (``kv_load_failure_policy``). Waiting requests that hold loaded blocks
give them back (they stay cached) before a running request is preempted or
when the head of the queue does not fit, so loads never deadlock the pool. A
request aborted while loading keeps its blocks until the worker is done.

Leases (prefill side): a ``do_remote_decode`` request that finishes keeps its
prompt's full blocks, offered to decode engines, until one releases them or
``kv_lease_seconds`` pass; its final output carries the ``kv_transfer_params``
a decode engine needs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from heron.core.hashing import BlockHash, update_block_hashes
from heron.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from heron.core.kv_remote import RemoteLoad
from heron.core.request_queue import RequestQueue
from heron.request import Request, RequestStatus

if TYPE_CHECKING:
    from heron.config import CacheConfig, KVTransferConfig

logger = logging.getLogger(__name__)


class SchedulerKVMixin:
    # the scheduler's own state this half works with
    kv_cache_manager: KVCacheManager
    waiting: RequestQueue
    requests: dict[str, Request]
    _failed_requests: list[Request]
    _failure_errors: dict[str, str | None]

    def _free_request(self, request: Request, keep_blocks: bool = False) -> None: ...

    def _init_kv_connector(self, cache_config: CacheConfig, kv_transfer: KVTransferConfig | None) -> None:
        self.kv_load_failure_policy = cache_config.kv_load_failure_policy
        self.kv_transfer = kv_transfer
        self.kv_transfer_address: str | None = None  # where this engine's block server listens (producer)
        # requests whose blocks are being loaded (aborted ones too, until the worker is done)
        self.loading: dict[str, Request] = {}
        # waiting requests that hold the blocks loaded for them, in the order they were loaded
        self._holding: dict[str, Request] = {}
        self._remote_loads: list[RemoteLoad] = []
        # finished prefills whose blocks wait for a decode engine: id -> (request, deadline)
        self._leases: dict[str, tuple[Request, float]] = {}
        self._new_offers: list[tuple[str, list[int], list[BlockHash]]] = []
        # the last schedule() found the pool short (a request did not fit, or one was preempted)
        self.kv_pool_short = False

    @property
    def is_loading_kv(self) -> bool:
        return bool(self.loading)

    @property
    def has_kv_leases(self) -> bool:
        return bool(self._leases)

    def wait_for_kv_lookups(self, timeout: float) -> None:
        if self.kv_cache_manager.disk is not None:
            self.kv_cache_manager.disk.wait_for_probe(timeout)

    def close(self) -> None:
        """Stop the disk tier's background lookups."""
        if self.kv_cache_manager.disk is not None:
            self.kv_cache_manager.disk.close()

    @property
    def is_looking_up_kv(self) -> bool:
        """The disk tier is finding out, in the background, how far some waiting
        request's prefix goes on disk."""
        disk = self.kv_cache_manager.disk
        return disk is not None and disk.is_probing

    # ---- loading -------------------------------------------------------------

    def update_kv_loads(self, finished: list[tuple[str, list[BlockHash]]],
                        errors: dict[str, str] | None = None, misses: set[str] | None = None) -> None:
        """The worker is done loading these requests' blocks (with the hashes it
        could not load; ``errors``: why, by request id, for a failed request to
        tell; ``misses``: requests whose first failed block was simply not there,
        a block file another replica sharing the disk tier deleted: a cache miss,
        computed again under either policy, as if the lookup had missed)."""
        for request_id, failed in finished:
            request = self.loading[request_id]
            num_computed = self.kv_cache_manager.finish_load(request, failed)
            del self.loading[request_id]
            if request.is_finished:  # aborted while loading
                self.kv_cache_manager.free(request)
                continue
            request.status = RequestStatus.WAITING
            missed = request_id in (misses or ())
            if failed and missed:
                logger.info("%s: %d prefix blocks were gone from the disk tier (deleted by a replica sharing it): "
                            "computed again", request_id, len(failed))
            elif failed:
                logger.warning("%s: %d prefix blocks could not be loaded (%s)",
                               request_id, len(failed), self.kv_load_failure_policy)
            if failed:
                if self.kv_load_failure_policy == "fail" and not missed:
                    self.kv_cache_manager.free(request)  # the blocks before the failure stay cached
                    request.num_cached_tokens = -1
                    why = (errors or {}).get(request_id)
                    self._fail_request(request, f"{len(failed)} of its prompt's KV blocks could not be loaded"
                                                + (f" ({why})" if why else ""))
                    continue
                # it keeps the blocks before the failure, and computes the rest (freed and admitted again, it
                # found them in the prefix cache, except those of a request that does not share its cache)
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            self._holding[request_id] = request
            self.waiting.add_preempted(request)

    def _release_held_blocks(self, keep: Request | None = None) -> bool:
        """Free the blocks of the waiting request loaded last (not ``keep``): they
        stay cached, to be hit or loaded again when it is admitted. False when no
        waiting request holds blocks."""
        for request_id in reversed(self._holding):
            request = self._holding[request_id]
            if request is not keep:
                del self._holding[request_id]
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                return True
        return False

    def _start_load(self, request: Request, computed_blocks: KVCacheBlocks, num_hit_tokens: int) -> bool:
        """The head of the queue, whose prefix goes on on disk, to ``loading``;
        False when the pool is short."""
        if not self.kv_cache_manager.start_load(request, computed_blocks):
            return False
        self._to_loading(request, num_hit_tokens)
        return True

    def _start_remote_load(self, request: Request) -> bool | None:
        """The head of the queue, prefilled by another engine, to ``loading``
        (True); False when the pool is short; None when there is nothing to pull
        (admit it as usual)."""
        params = request.sampling_params.kv_transfer_params
        if (not params or not params.get("do_remote_prefill") or request.remote_prefill_tried
                or self.kv_transfer is None or not self.kv_transfer.consumes):
            return None
        block_size = self.kv_cache_manager.block_size
        if params.get("remote_block_size") != block_size:
            logger.warning("%s: the prefill engine's blocks hold %s tokens, ours %d (%s)", request.request_id,
                           params.get("remote_block_size"), block_size, self.kv_load_failure_policy)
            request.remote_prefill_tried = True
            self._release_remote(request, params)  # nothing will be pulled: its lease held the blocks till expiry
            if self.kv_load_failure_policy == "fail":
                self.waiting.pop()  # the head of the queue: this request
                self._fail_request(request, f"the prefill engine's KV blocks hold {params.get('remote_block_size')} "
                                            f"tokens, this engine's {block_size}")
                return True
            return None
        if request.sampling_params.prompt_logprobs is not None:
            # every prompt position's logprobs need the prompt computed here (as a local
            # prefix hit would be refused): the prefill engine may free its copy
            request.remote_prefill_tried = True
            self._release_remote(request, params)
            return None
        hits, _ = self.kv_cache_manager.get_computed_blocks(request, tiers=False)
        num_blocks = min(int(params.get("remote_num_blocks", 0)), (request.num_tokens - 1) // block_size)
        if num_blocks <= len(hits.blocks):  # cached here already: the prefill engine may free its copy
            request.remote_prefill_tried = True
            self._release_remote(request, params)
            return None
        blocks = self.kv_cache_manager.start_remote_load(request, hits, num_blocks)
        if blocks is None:
            return False
        request.shares_cache = self.kv_transfer.trusts_peers
        self.kv_cache_manager.record_lookup(request, hits)
        request.remote_prefill_tried = True
        self._remote_loads.append(RemoteLoad(request.request_id, str(params["remote_engine_address"]),
                                             str(params["remote_request_id"]), len(hits.blocks), blocks))
        self._to_loading(request, num_blocks * block_size)
        return True

    def _release_unpulled(self, request: Request) -> None:
        """A request that ends before it tried its pull (aborted while it waited)
        releases the prefill engine's lease: else the blocks stayed held there
        until the lease expired, pushing out leases about to be pulled."""
        params = request.sampling_params.kv_transfer_params
        if (params and params.get("do_remote_prefill") and not request.remote_prefill_tried
                and self.kv_transfer is not None and self.kv_transfer.consumes):
            request.remote_prefill_tried = True
            self._release_remote(request, params)

    def _release_remote(self, request: Request, params: dict[str, Any]) -> None:
        """Tell the prefill engine it may free its copy: nothing will be pulled."""
        self._remote_loads.append(RemoteLoad(request.request_id, str(params["remote_engine_address"]),
                                             str(params["remote_request_id"]), 0, []))

    def _fail_request(self, request: Request, reason: str) -> None:
        """End a request whose prefix could not be had (``kv_load_failure_policy``
        "fail"): finished "error", ``reason`` for its client."""
        request.status = RequestStatus.FINISHED_ERROR
        self._failed_requests.append(request)
        self._failure_errors[request.request_id] = f"{reason} (kv_load_failure_policy 'fail')"
        self._free_request(request)

    def _to_loading(self, request: Request, num_hit_tokens: int) -> None:
        self.waiting.pop()
        self.loading[request.request_id] = request
        request.status = RequestStatus.WAITING_FOR_KV
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens

    def take_remote_loads(self) -> list[RemoteLoad]:
        """Pulls from prefill engines to start now (one with no blocks: only a release)."""
        loads, self._remote_loads = self._remote_loads, []
        return loads

    # ---- leases (prefill side) -------------------------------------------------

    def _lease(self, request: Request) -> dict[str, Any] | None:
        """A finished ``do_remote_decode`` request keeps its prompt's full blocks for
        a decode engine: the ``kv_transfer_params`` that engine needs (None: not such
        a request, or nothing to keep)."""
        params = request.sampling_params.kv_transfer_params
        if (not params or not params.get("do_remote_decode") or self.kv_transfer is None
                or not self.kv_transfer.produces or request.status == RequestStatus.FINISHED_ABORTED):
            return None
        block_size = self.kv_cache_manager.block_size
        num_blocks = min(request.num_prompt_tokens, request.num_computed_tokens) // block_size
        if num_blocks == 0:
            return None
        assert self.kv_transfer_address is not None
        self._leases[request.request_id] = (request, time.monotonic() + self.kv_transfer.kv_lease_seconds)
        # the blocks' hashes go with them: a pull must name the same prompt (and cache salt)
        hashes = update_block_hashes(request, block_size)[:num_blocks]
        self._new_offers.append((request.request_id,
                                 self.kv_cache_manager.get_block_ids(request.request_id)[:num_blocks], hashes))
        return {"do_remote_prefill": True, "remote_engine_address": self.kv_transfer_address,
                "remote_request_id": request.request_id, "remote_num_blocks": num_blocks,
                "remote_block_size": block_size}

    def take_kv_offers(self) -> list[tuple[str, list[int], list[BlockHash]]]:
        """Leased blocks to offer to decode engines now: (request id, block ids, their hashes)."""
        offers, self._new_offers = self._new_offers, []
        return offers

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Leases past their deadline and, when the last step found the pool short,
        the oldest other one too: a decode engine that never comes must not hold
        this engine's own requests back for ``kv_lease_seconds`` (one a step, so a
        pull about to come is the last to go; a lost one is recomputed there)."""
        now = time.monotonic() if now is None else now
        expired = [request_id for request_id, (_, deadline) in self._leases.items() if deadline <= now]
        if self.kv_pool_short and len(expired) < len(self._leases):
            oldest = next(request_id for request_id in self._leases if request_id not in expired)
            logger.warning("the KV pool is short: freeing the oldest prefill lease (%s) before it expires", oldest)
            expired.append(oldest)
        return expired

    def release_leases(self, request_ids: list[str]) -> None:
        """Free leased blocks (released by a decode engine, or expired and withdrawn)."""
        for request_id in request_ids:
            entry = self._leases.pop(request_id, None)
            if entry is not None:
                self.kv_cache_manager.free(entry[0])
