from heron.core.kv_cache_manager import KVCacheManager
from tests.helpers import make_request


def test_allocation_gives_exact_blocks_and_caches_full_ones():
    manager = KVCacheManager(num_blocks=8, block_size=16)
    request = make_request(40)
    blocks, num_hit = manager.get_computed_blocks(request)
    assert (len(blocks), num_hit) == (0, 0)
    new = manager.allocate_slots(request, 40)
    assert new is not None and new.get_block_ids() == [0, 1, 2]
    # 2 full blocks are registered in the prefix cache, the partial one is not
    assert len(manager.block_pool.cached_blocks) == 2
    assert manager.block_pool.blocks[2].block_hash is None
    manager.check_integrity()


def test_prefix_hit_shares_blocks_and_leaves_a_token_to_compute():
    manager = KVCacheManager(num_blocks=8, block_size=16)
    first = make_request(40, token_offset=0)
    manager.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    second = make_request(36, token_offset=0)  # same first 36 tokens
    hits, num_hit = manager.get_computed_blocks(second)
    assert hits.get_block_ids() == [0, 1] and num_hit == 32
    manager.record_lookup(second, hits)
    new = manager.allocate_slots(second, 36 - 32, new_computed_blocks=hits, num_new_computed_tokens=num_hit)
    assert new is not None and new.get_block_ids() == [3]
    assert manager.get_block_ids(second.request_id) == [0, 1, 3]
    assert manager.block_pool.blocks[0].ref_cnt == 2
    # exactly two full blocks cached: the last token must still be computed
    exact = make_request(32, token_offset=0)
    hits, num_hit = manager.get_computed_blocks(exact)
    assert hits.get_block_ids() == [0] and num_hit == 16
    manager.record_lookup(exact, hits)
    stats = manager.prefix_cache_stats
    assert (stats.queries, stats.hits, stats.requests) == (36 + 32, 32 + 16, 2)
    manager.check_integrity()


def test_cache_salt_prevents_sharing():
    manager = KVCacheManager(num_blocks=8, block_size=16)
    manager.allocate_slots(make_request(40, token_offset=0, cache_salt="a"), 40)
    hits, num_hit = manager.get_computed_blocks(make_request(40, token_offset=0, cache_salt="b"))
    assert num_hit == 0


def test_prefix_caching_can_be_disabled():
    manager = KVCacheManager(num_blocks=8, block_size=16, enable_caching=False)
    manager.allocate_slots(make_request(40), 40)
    _, num_hit = manager.get_computed_blocks(make_request(40))
    assert num_hit == 0 and manager.block_pool.cached_blocks == {}


def test_short_pool_returns_none_and_changes_nothing():
    manager = KVCacheManager(num_blocks=3, block_size=16)
    big = make_request(40)
    assert manager.allocate_slots(big, 40) is not None
    other = make_request(20, token_offset=500)
    assert manager.allocate_slots(other, 20) is None
    assert other.request_id not in manager.req_to_blocks
    assert manager.num_free_blocks == 0
    manager.check_integrity()


def test_a_hit_on_a_free_block_counts_against_free_space():
    manager = KVCacheManager(num_blocks=3, block_size=16)
    first = make_request(33, token_offset=0)
    manager.allocate_slots(first, 33)
    manager.free(first)
    # blocks 0 and 1 are cached and free; a 33-token copy hits 2 blocks and needs 1 more:
    again = make_request(33, token_offset=0)
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 32
    assert manager.allocate_slots(again, 1, new_computed_blocks=hits, num_new_computed_tokens=num_hit) is not None
    assert manager.get_block_ids(again.request_id) == [0, 1, 2]
    manager.check_integrity()


def test_free_returns_tail_blocks_first_in_eviction_order():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    request = make_request(64)
    manager.allocate_slots(request, 64)
    manager.free(request)
    assert [b.block_id for b in manager.block_pool.free_queue] == [3, 2, 1, 0]
    manager.check_integrity()


def test_decode_growth_allocates_a_block_only_at_a_boundary():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request(4)
    manager.allocate_slots(request, 4)
    request.num_computed_tokens = 4
    request.append_output_token_ids([11])
    new = manager.allocate_slots(request, 1)
    assert new is not None and new.get_block_ids() == [1]
    request.num_computed_tokens = 5
    request.append_output_token_ids([12])
    new = manager.allocate_slots(request, 1)
    assert new is not None and new.get_block_ids() == []


def test_blocks_registered_for_a_withdrawn_grant_leave_the_prefix_cache():
    """A request preempted in the step that granted it tokens never computes them:
    the blocks those tokens completed must not stay cached (a later request would
    read K/V nobody wrote), while the blocks computed before stay."""
    manager = KVCacheManager(num_blocks=8, block_size=16)
    request = make_request(40)
    manager.allocate_slots(request, 16)
    request.num_computed_tokens = 16  # the first step ran
    manager.allocate_slots(request, 24)  # granted, then the request is preempted before computing it
    assert len(manager.block_pool.cached_blocks) == 2
    manager.free(request, request.num_computed_tokens)
    assert len(manager.block_pool.cached_blocks) == 1
    hits, num_hit = manager.get_computed_blocks(make_request(40))
    assert num_hit == 16
    manager.check_integrity()
