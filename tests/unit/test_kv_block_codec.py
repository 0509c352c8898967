"""Blocks as bytes and back (``worker/kv_block_codec.py``): each row holds a
block's layers in order, for caches of mixed dtypes (a draft model's float32
beside a float16 pool), and rows restore into the right blocks only; a load
the copy fails is reported failed rather than left waiting."""

from __future__ import annotations

import torch

from heron.core.kv_disk_index import DiskLoad, DiskOps
from heron.core.kv_disk_layout import DiskTierLayout
from heron.worker.kv_block_codec import BlockCodec
from heron.worker.kv_disk_store import DiskKVStore
from heron.worker.kv_load_reports import LoadReports


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


def test_a_load_that_breaks_reports_every_block_failed(tmp_path, monkeypatch):
    """An unexpected error while copying a load into the pool (a bug, a device
    mismatch) is reported as a failed load (the request recomputes), and the
    loader thread lives on: nothing waits for ever."""
    pool = caches()
    codec = BlockCodec(pool)
    layout = DiskTierLayout.create(tmp_path, b"f" * 16, codec.block_bytes)
    reports = LoadReports()
    store = DiskKVStore(layout, pool, reports)
    store.apply(DiskOps(writes=[(1, b"a" * 32), (2, b"b" * 32)]))
    assert store.flush()

    def broken(payloads, block_ids):
        raise RuntimeError("index_copy(): expected the same device")

    monkeypatch.setattr(store.codec, "restore", broken)
    store.apply(DiskOps(loads=[DiskLoad("r", [(b"a" * 32, 5), (b"b" * 32, 6)])]))
    reports.wait(10)
    assert reports.take() == [("r", [b"a" * 32, b"b" * 32])]
    monkeypatch.undo()
    store.apply(DiskOps(loads=[DiskLoad("s", [(b"a" * 32, 7)])]))
    reports.wait(10)
    assert reports.take() == [("s", [])]
    assert torch.equal(pool[1][:, 7], pool[1][:, 1])
    store.close()
