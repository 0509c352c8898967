from heron.core.hashing import hash_block_tokens, update_block_hashes
from tests.helpers import make_request


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert base == hash_block_tokens(None, [1, 2, 3, 4])
    assert base != hash_block_tokens(None, [1, 2, 3, 5])
    assert base != hash_block_tokens(hash_block_tokens(None, [9]), [1, 2, 3, 4])
    assert base != hash_block_tokens(None, [1, 2, 3, 4], ("salt:a",))
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt:a",)) != hash_block_tokens(None, [1, 2, 3, 4], ("salt:b",))


def test_only_full_blocks_are_hashed_and_the_chain_extends():
    request = make_request(10)
    assert len(update_block_hashes(request, block_size=4)) == 2
    hashes_before = list(request.block_hashes)
    request.append_output_token_ids([5, 6])
    assert len(update_block_hashes(request, block_size=4)) == 3
    assert request.block_hashes[:2] == hashes_before
    tokens = request.all_token_ids
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], tokens[8:12])


def test_equal_prefixes_hash_equal_and_salts_separate_them():
    a = make_request(8, token_ids=[1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request(8, token_ids=[1, 2, 3, 4, 9, 9, 9, 9])
    c = make_request(8, token_ids=[1, 2, 3, 4, 5, 6, 7, 8], cache_salt="tenant-b")
    ha, hb, hc = (update_block_hashes(r, 4) for r in (a, b, c))
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert hc[0] != ha[0] and hc[1] != ha[1]
