"""KV blocks to bytes and back from a pool on the GPU (the disk tier's writes
and loads and P/D transfers of a CUDA engine): rows come back to the host and
go into the right device blocks."""

from __future__ import annotations

import pytest
import torch

from heron.worker.kv_block_codec import BlockCodec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_blocks_round_trip_through_the_host():
    generator = torch.Generator().manual_seed(0)
    pool = [torch.randn(2, 9, 4, 3, 8, generator=generator).to(dtype).cuda()
            for dtype in (torch.float16, torch.bfloat16, torch.float32)]
    codec = BlockCodec(pool)
    rows = codec.capture([1, 8, 3])
    assert rows.device.type == "cpu" and rows.shape == (3, codec.block_bytes)
    empty = [torch.zeros_like(cache) for cache in pool]
    BlockCodec(empty).restore(rows, [4, 0, 6])
    for source, target in zip(pool, empty):
        for source_id, target_id in zip([1, 8, 3], [4, 0, 6]):
            assert torch.equal(target[:, target_id], source[:, source_id])
        assert not target[:, [1, 2, 3, 5, 7, 8]].any()
