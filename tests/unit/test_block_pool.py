import pytest

from heron.core.block_pool import BlockPool
from heron.core.hashing import hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def test_new_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert free_ids(pool) == [3, 4, 5]
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(0.5)
    pool.check_integrity([blocks])


def test_freed_blocks_join_the_back_in_the_given_order():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 4, 2]


def test_too_many_blocks_and_double_free_raise():
    pool = BlockPool(num_blocks=2, enable_caching=True)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])


def test_cached_free_blocks_are_evicted_lazily_in_lru_order():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    hashes = [hash_block_tokens(None, [i] * 4) for i in range(4)]
    pool.cache_full_blocks(blocks, hashes, 0, 4)
    assert pool.get_cached_block(hashes[2]) is blocks[2]
    pool.free_blocks([blocks[1], blocks[3], blocks[0], blocks[2]])
    # still cached while free
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    # allocation takes the least recently freed first and forgets its hash
    [taken] = pool.get_new_blocks(1)
    assert taken.block_id == 1
    assert taken.block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[3]) is blocks[3]
    pool.check_integrity([[taken]])


def test_touching_a_cached_free_block_takes_it_out_of_the_queue():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [7, 8])
    pool.cache_full_blocks(blocks, [block_hash], 0, 1)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [2, 0, 1]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert free_ids(pool) == [2, 1]
    pool.touch([blocks[0]])  # a second owner
    assert blocks[0].ref_cnt == 2
    pool.check_integrity([[blocks[0]], [blocks[0]]])


def test_duplicate_content_keeps_the_first_block_canonical():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [1, 2, 3])
    pool.cache_full_blocks([first], [block_hash], 0, 1)
    pool.cache_full_blocks([second], [block_hash], 0, 1)
    assert pool.get_cached_block(block_hash) is first
    pool.free_blocks([second, first])
    pool.get_new_blocks(2)  # evicts 2 then `second`: the map must still point at `first`
    assert pool.get_cached_block(block_hash) is first


def test_caching_disabled_registers_nothing():
    pool = BlockPool(num_blocks=2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [hash_block_tokens(None, [1])], 0, 1)
    assert pool.cached_blocks == {}
    assert blocks[0].block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(num_blocks=2, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [hash_block_tokens(None, [1])], 0, 1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and blocks[0].block_hash is None


def test_integrity_check_catches_a_wrong_ref_count():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    blocks[1].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref_cnt"):
        pool.check_integrity([blocks])
