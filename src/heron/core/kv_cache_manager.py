"""Per-request block tables over the block pool, with prefix-cache lookup.

The scheduler talks to this class only: it asks which prefix of a new request is
already cached (``get_computed_blocks``), then asks for slots for the tokens it
grants (``allocate_slots``), and frees a request's blocks when it finishes or is
preempted (``free``). ``KVCacheBlocks`` hides the block objects from it.

Blocks are registered in the prefix cache as soon as they are allocated for a
step that fills them: they are computed by that very step, and every layer writes
the step's K/V into the cache before attending, so even a second request that
hits them in the same step reads valid K/V.

Offload tiers (``core/kv_offload.py`` host memory, ``core/kv_disk_index.py``
disk) extend a prefix beyond the pool. Blocks from the host tier are copied in
before the step runs and count as computed at once; blocks from disk are read
in the background (``start_load``): the request owns its blocks but none is
registered until ``finish_load``, so nothing reads them half-written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from heron.core.block_pool import BlockPool, KVCacheBlock
from heron.core.hashing import BlockHash, update_block_hashes
from heron.core.kv_disk_index import DiskIndex
from heron.core.kv_disk_layout import DiskTierLayout
from heron.core.kv_events import KVCacheEvent, KVEventRecorder
from heron.core.kv_offload import KVTransfers, OffloadIndex
from heron.request import Request
from heron.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheBlocks:
    """An opaque handle on some blocks, given to the scheduler. From
    ``get_computed_blocks``: the pool's hits, then the hashes of the blocks
    that follow them in an offload tier (loaded when the slots are allocated),
    each marked with whether it is on disk (read in the background)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    offloaded: list[BlockHash] = field(default_factory=list)
    on_disk: list[bool] = field(default_factory=list)
    # the disk tier is still finding out how far the prefix goes: nothing is
    # known yet, admit the request in a later step
    lookup_pending: bool = False

    @property
    def needs_load(self) -> bool:
        """Some blocks come from disk: the request waits for them (``start_load``)."""
        return any(self.on_disk)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted in tokens, like vLLM: queries = tokens looked up, hits = tokens found."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class _PendingLoad:
    """A request's blocks being loaded in the background: its prefix from the
    first block past its pool hits, and which of those come from disk (the rest
    from the host tier; all of them from a prefill engine when ``remote``)."""

    first_block: int
    block_hashes: list[BlockHash]
    on_disk: list[bool]
    remote: bool = False


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, enable_kv_events: bool = False,
        num_offload_blocks: int = 0, disk_layout: DiskTierLayout | None = None, disk_max_bytes: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        """``num_offload_blocks``: the size of a host-memory KV offload tier
        (``core/kv_offload.py``; 0: none); ``disk_layout``: a disk tier's
        directory (``core/kv_disk_layout.py``; None: none), bounded to ``disk_max_bytes``.
        ``max_model_len``: no request holds slots past it, lookahead included (a
        pool sized for that length never has a request wait for blocks it cannot get)."""
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # what the prefix cache gained and lost since the last take_events()
        self.events = KVEventRecorder() if enable_kv_events and enable_caching else None
        self.offload = (OffloadIndex(num_offload_blocks, self._tier_dropped)
                        if num_offload_blocks and enable_caching else None)
        self.disk = (DiskIndex(disk_layout, disk_max_bytes, self._tier_dropped)
                     if disk_layout is not None and enable_caching else None)
        self.block_pool = BlockPool(num_blocks, enable_caching, self.events,
                                    self._pool_evicted if self.offload is not None or self.disk is not None else None)
        self.loading: dict[str, _PendingLoad] = {}
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # how many leading blocks of each request are registered in the prefix cache
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request, tiers: bool = True) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a request that has no blocks yet, as blocks
        and a token count (``tiers``: continued in the offload tiers; a disk tier
        may not know yet: ``lookup_pending``, ask again next step). At least one
        token is always left to compute, since the last position's logits are
        needed to sample."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return KVCacheBlocks(), 0  # prompt logprobs need every prompt position computed
        block_hashes = update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        found = KVCacheBlocks(hits)
        tier_hashes = block_hashes[len(hits):max_hit_blocks] if tiers else []
        for index, block_hash in enumerate(tier_hashes):
            if self.offload is not None and block_hash in self.offload:
                found.on_disk.append(False)
            else:
                on_disk = self.disk.lookup(tier_hashes[index:]) if self.disk is not None else False
                if on_disk is None:
                    return KVCacheBlocks(lookup_pending=True), 0
                if not on_disk:
                    break
                found.on_disk.append(True)
            found.offloaded.append(block_hash)
        return found, (len(hits) + len(found.offloaded)) * self.block_size

    def forget_failed_disk_writes(self, blocks: list[BlockHash]) -> None:
        """The disk tier's writes of these blocks failed: it does not hold them."""
        if blocks and self.disk is not None:
            self.disk.forget_failed_writes(blocks)

    def record_lookup(self, request: Request, found: KVCacheBlocks) -> None:
        """Count the prefix ``get_computed_blocks`` found for a request that was
        admitted (or went on to load it): a request waiting for room is looked up
        again each step, and counting each lookup made the hit rate follow the
        requests stuck in the queue. The re-admission of a preempted request is
        its own recompute, not a prefix shared: it counts in the tiers' hits
        only (as vLLM keeps it out of the hit rate)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return  # looked nothing up
        num_on_disk = sum(found.on_disk)
        if self.offload is not None:
            self.offload.stats.hit_tokens += (len(found.offloaded) - num_on_disk) * self.block_size
        if self.disk is not None:
            self.disk.stats.hit_tokens += num_on_disk * self.block_size
        if request.num_preemptions:
            return
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += len(found.blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        *,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed
        ones (plus prefix hits given by ``get_computed_blocks``). Returns the newly
        allocated blocks, or None, changing nothing, when the pool is short."""
        request_id = request.request_id
        if new_computed_blocks is None and num_new_computed_tokens == 0 and request_id in self.req_to_blocks:
            # the common decode step: the tokens fit the blocks it owns and fill
            # none that needs caching (what the general path below would conclude)
            num_tokens = request.num_computed_tokens + num_new_tokens
            if cdiv(self._slots(num_tokens, num_lookahead_tokens), self.block_size) <= len(
                    self.req_to_blocks[request_id]) and (
                not self.enable_caching
                or min(num_tokens, request.num_tokens) // self.block_size <= self.num_cached_blocks.get(request_id, 0)
            ):
                return KVCacheBlocks()
        owned = self.req_to_blocks.setdefault(request_id, [])
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required_blocks = cdiv(self._slots(num_computed + num_new_tokens, num_lookahead_tokens), self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(owned) - len(hits))
        # a hit on a free block takes that block out of the free pool too
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.num_free_blocks:
            if not owned:
                del self.req_to_blocks[request_id]
            return None
        if hits:
            self.block_pool.touch(hits)
            owned.extend(hits)
            self.num_cached_blocks[request_id] = len(owned)
        offloaded = new_computed_blocks.offloaded if new_computed_blocks is not None else []
        assert new_computed_blocks is None or not new_computed_blocks.needs_load, "disk hits go to start_load"
        new_blocks = self._take_blocks_for(offloaded, num_new_blocks)
        owned.extend(new_blocks)
        if self.enable_caching:
            num_tokens_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
            self._register(request, num_tokens_to_cache // self.block_size)
        return KVCacheBlocks(new_blocks)

    def _slots(self, num_tokens: int, num_lookahead_tokens: int) -> int:
        """Slots a request needs for ``num_tokens`` and the draft tokens after them,
        none past the model's length (drafts never go there)."""
        slots = num_tokens + num_lookahead_tokens
        return slots if self.max_model_len is None else max(num_tokens, min(slots, self.max_model_len))

    def _take_blocks_for(self, tier_hashes: list[BlockHash], num_blocks: int,
                         on_disk: list[bool] | None = None) -> list[KVCacheBlock]:
        """``num_blocks`` new blocks, the first ones to be filled from the tiers with
        ``tier_hashes`` (host-tier copies are queued here; disk reads are the caller's)."""
        on_host = [block_hash for i, block_hash in enumerate(tier_hashes) if not (on_disk and on_disk[i])]
        if on_host:
            assert self.offload is not None
            self.offload.pin(on_host)  # before allocating: the evictions it causes save into the tier
        new_blocks = self.block_pool.get_new_blocks(num_blocks)
        for i, (block_hash, block) in enumerate(zip(tier_hashes, new_blocks, strict=False)):
            if not (on_disk and on_disk[i]):
                assert self.offload is not None
                self.offload.load(block_hash, block.block_id)
        return new_blocks

    def _register(self, request: Request, num_full_blocks: int) -> None:
        """Register the request's blocks up to ``num_full_blocks`` in the prefix
        cache; the disk tier writes each newly registered one through."""
        request_id = request.request_id
        num_cached = self.num_cached_blocks.get(request_id, 0)
        if num_full_blocks <= num_cached:
            return
        if not request.shares_cache:  # counted as done (the decode fast path), never findable by others
            self.num_cached_blocks[request_id] = num_full_blocks
            return
        owned = self.req_to_blocks[request_id]
        block_hashes = update_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(
            owned, block_hashes, num_cached, num_full_blocks, request.all_token_ids, self.block_size
        )
        self.num_cached_blocks[request_id] = num_full_blocks
        if self.disk is not None:
            for block, block_hash in zip(owned[num_cached:num_full_blocks], block_hashes[num_cached:], strict=False):
                if block.block_hash == block_hash:  # not when an equal block was cached already
                    self.disk.write_through(block.block_id, block_hash)

    def start_load(self, request: Request, computed: KVCacheBlocks) -> bool:
        """Give a request with no blocks yet its pool hits and new blocks for its
        tier hits, and start reading the disk ones; False, changing nothing, when
        the pool is short. Its blocks are registered by ``finish_load``."""
        assert self.disk is not None and request.request_id not in self.req_to_blocks
        num_free_hits = sum(1 for block in computed.blocks if block.ref_cnt == 0)
        if len(computed.offloaded) + num_free_hits > self.block_pool.num_free_blocks:
            return False
        self.block_pool.touch(computed.blocks)
        owned = self.req_to_blocks[request.request_id] = list(computed.blocks)
        self.num_cached_blocks[request.request_id] = len(owned)
        new_blocks = self._take_blocks_for(computed.offloaded, len(computed.offloaded), computed.on_disk)
        owned.extend(new_blocks)
        self.disk.load(request.request_id, [
            (block_hash, block.block_id)
            for block_hash, block, on_disk in zip(computed.offloaded, new_blocks, computed.on_disk, strict=True)
            if on_disk
        ])
        self.loading[request.request_id] = _PendingLoad(len(computed.blocks), computed.offloaded, computed.on_disk)
        return True

    def start_remote_load(self, request: Request, hits: KVCacheBlocks, num_blocks: int,
                          ) -> list[tuple[BlockHash, int]] | None:
        """Give a request with no blocks yet its pool hits and new blocks up to its
        first ``num_blocks`` prompt blocks, to be pulled from a prefill engine:
        (hash, pool block id) of each, or None, changing nothing, when the pool
        is short. Registered by ``finish_load``."""
        assert request.request_id not in self.req_to_blocks and num_blocks > len(hits.blocks)
        num_new = num_blocks - len(hits.blocks)
        num_free_hits = sum(1 for block in hits.blocks if block.ref_cnt == 0)
        if num_new + num_free_hits > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(hits.blocks)
        owned = self.req_to_blocks[request.request_id] = list(hits.blocks)
        self.num_cached_blocks[request.request_id] = len(owned)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        owned.extend(new_blocks)
        block_hashes = update_block_hashes(request, self.block_size)[len(hits.blocks):num_blocks]
        self.loading[request.request_id] = _PendingLoad(len(hits.blocks), block_hashes, [False] * num_new, True)
        return [(block_hash, block.block_id) for block_hash, block in zip(block_hashes, new_blocks, strict=True)]

    def finish_load(self, request: Request, failed: list[BlockHash]) -> int:
        """The worker finished reading a request's blocks (``failed``: those it
        could not). Registers the blocks before the first failure and returns
        how many of the request's tokens they hold."""
        load = self.loading.pop(request.request_id)
        failed_set = set(failed)
        num_good = next((i for i, h in enumerate(load.block_hashes) if h in failed_set), len(load.block_hashes))
        if not load.remote:
            assert self.disk is not None
            self.disk.finish_load([h for h, on_disk in zip(load.block_hashes, load.on_disk, strict=True) if on_disk],
                                  failed, num_used=sum(load.on_disk[:num_good]))
        num_blocks = load.first_block + num_good
        self._register(request, num_blocks)
        return num_blocks * self.block_size

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def free(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Release a request's blocks. Its tail blocks are evicted first: they are
        the least likely to be shared by later requests. ``num_computed_tokens``
        (a request preempted in the step that granted it more): blocks past
        those tokens were registered for a step that will not compute them, and
        leave the prefix cache (and the disk tier's queue) first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        if num_computed_tokens is not None:
            for block in blocks[num_computed_tokens // self.block_size:num_cached]:
                block_hash = self.block_pool.uncache(block)
                if block_hash is not None:
                    self._uncomputed_dropped(block_hash)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget the pool's cached prefixes and the offload tier's (only when no block is in use)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.clear()
        if self.disk is not None:
            self.disk.clear()
        return True

    def _pool_evicted(self, block_id: int, block_hash: BlockHash) -> bool:
        """A cached pool block is reused: the host tier keeps it (write-back);
        whether a tier holds it now (the disk tier has it already if it does)."""
        kept = self.offload.save(block_id, block_hash) if self.offload is not None else False
        return kept or (self.disk is not None and self.disk.holds(block_hash))

    def _uncomputed_dropped(self, block_hash: BlockHash) -> None:
        if self.disk is not None:
            self.disk.forget_unwritten(block_hash)
        self._tier_dropped(block_hash)

    def _tier_dropped(self, block_hash: BlockHash) -> None:
        """A tier gave a block up: removed for good unless the pool or the other tier holds it."""
        if self.events is None or self.block_pool.get_cached_block(block_hash) is not None:
            return
        if (self.offload is not None and block_hash in self.offload) or (
                self.disk is not None and self.disk.holds(block_hash)):
            return
        self.events.removed(block_hash)

    def take_transfers(self, idle: bool = False) -> KVTransfers | None:
        """The tier copies the next step must make first (None: no tier);
        ``idle``: no step is coming, the disk tier writes everything now."""
        if self.offload is None and self.disk is None:
            return None
        transfers = self.offload.take_transfers() if self.offload is not None else KVTransfers()
        if self.disk is not None:
            transfers.disk = self.disk.take_ops(idle)
        return transfers

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call ([] when events are off)."""
        return self.events.take() if self.events is not None else []

    def check_integrity(self) -> None:
        self.block_pool.check_integrity(self.req_to_blocks.values())
