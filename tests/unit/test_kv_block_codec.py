"""Blocks as bytes and back (``worker/kv_block_codec.py``): each row holds a
block's layers in order, for caches of mixed dtypes (a draft model's float32
beside a float16 pool), and rows restore into the right blocks only."""

from __future__ import annotations

import torch

from heron.worker.kv_block_codec import BlockCodec


def caches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [((2, 9, 4, 3, 8), torch.float16), ((2, 9, 4, 1, 16), torch.float32), ((2, 9, 4, 2, 8), torch.bfloat16)]
    return [torch.randn(shape, generator=generator).to(dtype) for shape, dtype in shapes]


def block_bytes(layers: list[torch.Tensor], block_id: int) -> bytes:
    """A block's bytes: each layer's ``cache[:, block]`` (K then V), in layer order."""
    return b"".join(cache[:, block_id].contiguous().view(torch.uint8).numpy().tobytes() for cache in layers)


def test_a_row_holds_each_layers_block_in_order():
    codec = BlockCodec(caches())
    block_ids = [7, 2, 5]
    rows = codec.capture(block_ids)
    assert rows.shape == (3, codec.block_bytes) and rows.dtype == torch.uint8
    for row, block_id in zip(rows, block_ids):
        assert row.numpy().tobytes() == block_bytes(codec.caches, block_id)


def test_many_blocks_restore_into_their_blocks_only():
    source, target = BlockCodec(caches()), BlockCodec([torch.zeros_like(cache) for cache in caches()])
    source_ids, target_ids = [1, 8, 3], [4, 0, 6]
    target.restore(source.capture(source_ids), target_ids)
    for source_cache, target_cache in zip(source.caches, target.caches):
        for source_id, target_id in zip(source_ids, target_ids):
            assert torch.equal(target_cache[:, target_id], source_cache[:, source_id])
        untouched = [block for block in range(9) if block not in target_ids]
        assert not target_cache[:, untouched].any()
