"""Per-request block tables over the block pool, with prefix-cache lookup.

The scheduler talks to this class only: it asks which prefix of a new request is
already cached (``get_computed_blocks``), then asks for slots for the tokens it
grants (``allocate_slots``), and frees a request's blocks when it finishes or is
preempted (``free``). ``KVCacheBlocks`` hides the block objects from it.

Blocks are registered in the prefix cache as soon as they are allocated for a
step that fills them: they are computed by that very step, and every layer writes
the step's K/V into the cache before attending, so even a second request that
hits them in the same step reads valid K/V.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from heron.core.block_pool import BlockPool, KVCacheBlock
from heron.core.hashing import BlockHash, update_block_hashes
from heron.core.kv_events import KVCacheEvent, KVEventRecorder
from heron.core.kv_offload import KVTransfers, OffloadIndex
from heron.request import Request
from heron.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheBlocks:
    """An opaque handle on some blocks, given to the scheduler. From
    ``get_computed_blocks``: the pool's hits, then the hashes of the blocks
    that follow them in an offload tier (loaded when the slots are allocated)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    offloaded: list[BlockHash] = field(default_factory=list)

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


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, enable_kv_events: bool = False,
        num_offload_blocks: int = 0,
    ) -> None:
        """``num_offload_blocks``: the size of a KV offload tier (``core/kv_offload.py``; 0: none)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        # what the prefix cache gained and lost since the last take_events()
        self.events = KVEventRecorder() if enable_kv_events and enable_caching else None
        self.offload = (OffloadIndex(num_offload_blocks, self._tier_dropped)
                        if num_offload_blocks and enable_caching else None)
        self.block_pool = BlockPool(num_blocks, enable_caching, self.events,
                                    self.offload.save if self.offload is not None else None)
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

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a request that has no blocks yet, as blocks
        and a token count. At least one token is always left to compute, since the
        last position's logits are needed to sample."""
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
        offloaded: list[BlockHash] = []
        if self.offload is not None:
            for block_hash in block_hashes[len(hits):max_hit_blocks]:
                if block_hash not in self.offload:
                    break
                offloaded.append(block_hash)
            self.offload.stats.hit_tokens += len(offloaded) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += len(hits) * self.block_size
        return KVCacheBlocks(hits, offloaded), (len(hits) + len(offloaded)) * self.block_size

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
            if cdiv(num_tokens + num_lookahead_tokens, self.block_size) <= len(self.req_to_blocks[request_id]) and (
                not self.enable_caching
                or min(num_tokens, request.num_tokens) // self.block_size <= self.num_cached_blocks.get(request_id, 0)
            ):
                return KVCacheBlocks()
        owned = self.req_to_blocks.setdefault(request_id, [])
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required_blocks = cdiv(
            num_computed + num_new_tokens + num_lookahead_tokens, self.block_size
        )
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
        if offloaded:
            assert self.offload is not None
            self.offload.pin(offloaded)  # before allocating: the evictions it causes save into the tier
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        owned.extend(new_blocks)
        for block_hash, block in zip(offloaded, new_blocks, strict=False):
            assert self.offload is not None
            self.offload.load(block_hash, block.block_id)
        if self.enable_caching:
            num_tokens_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
            num_full_blocks = num_tokens_to_cache // self.block_size
            num_cached = self.num_cached_blocks.get(request_id, 0)
            if num_full_blocks > num_cached:
                block_hashes = update_block_hashes(request, self.block_size)
                self.block_pool.cache_full_blocks(
                    owned, block_hashes, num_cached, num_full_blocks, request.all_token_ids, self.block_size
                )
                self.num_cached_blocks[request_id] = num_full_blocks
        return KVCacheBlocks(new_blocks)

    def free(self, request: Request) -> None:
        """Release a request's blocks. Its tail blocks are evicted first: they are
        the least likely to be shared by later requests."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget the pool's cached prefixes and the offload tier's (only when no block is in use)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.clear()
        return True

    def _tier_dropped(self, block_hash: BlockHash) -> None:
        if self.events is not None and self.block_pool.get_cached_block(block_hash) is None:
            self.events.removed(block_hash)

    def take_transfers(self) -> KVTransfers | None:
        """The offload copies the next step must make first (None: no tier)."""
        return self.offload.take_transfers() if self.offload is not None else None

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call ([] when events are off)."""
        return self.events.take() if self.events is not None else []

    def check_integrity(self) -> None:
        self.block_pool.check_integrity(self.req_to_blocks.values())
