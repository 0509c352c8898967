"""Blocks as bytes and back (``worker/kv_block_codec.py``): each row holds a
block's layers in order, for caches of mixed dtypes (a draft model's float32
beside a float16 pool), and rows restore into the right blocks only; a load
the copy fails is reported failed rather than left waiting; the disk tier's
writer outlives a failing delete, and a step's disk loads start after its
host-tier saves."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import torch

from heron.core.kv_disk_index import DiskLoad, DiskOps
from heron.core.kv_disk_layout import DiskTierLayout
from heron.core.kv_offload import KVTransfers
from heron.worker.kv_block_codec import BlockCodec
from heron.worker.kv_disk_store import DiskKVStore
from heron.worker.kv_load_reports import LoadReports
from heron.worker.kv_offload_store import HostKVStore
from heron.worker.model_runner import ModelRunner


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


def test_a_delete_the_file_system_refuses_leaves_the_writer_running(tmp_path):
    """A delete failing with anything but ENOENT (a read-only remount, EIO or
    ESTALE on NFS; here a directory where the file was) used to end the writer
    thread: the captured writes piled up to the buffer bound and every later
    step waited for ever."""
    pool = caches()
    codec = BlockCodec(pool)
    layout = DiskTierLayout.create(tmp_path, b"f" * 16, codec.block_bytes)
    store = DiskKVStore(layout, pool, LoadReports(), max_buffered_bytes=codec.block_bytes * 2)
    blocked = layout.path_for(b"x" * 32)
    blocked.parent.mkdir(exist_ok=True)
    blocked.mkdir()
    store.apply(DiskOps(deletes=[b"x" * 32], writes=[(1, b"a" * 32)]))
    store.apply(DiskOps(writes=[(2, b"b" * 32), (3, b"c" * 32)]))
    assert store.flush(timeout=10)
    assert layout.path_for(b"c" * 32).is_file() and blocked.is_dir()
    store.close()


def test_writers_sharing_a_directory_never_share_a_temporary_file(tmp_path, monkeypatch):
    """Temporary files were named by PID alone: two engines in one process (or
    replicas in separate PID namespaces on one shared file system) writing the
    same block truncated each other's file, and a reader could see half a block."""
    renamed: list[str] = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append(os.fspath(src)), replace(src, dst))[1])
    pool = caches()
    layout = DiskTierLayout.create(tmp_path, b"f" * 16, BlockCodec(pool).block_bytes)
    stores = [DiskKVStore(layout, pool, LoadReports()) for _ in range(2)]
    for store in stores:
        store.apply(DiskOps(writes=[(1, bytes([len(renamed)]) * 32)]))
        assert store.flush(timeout=10)
        store.close()
    suffixes = [name.split(".kv", 1)[1] for name in renamed]  # the part after the block's own name
    assert len(suffixes) == 2 and suffixes[0] != suffixes[1]
    assert all(suffix.endswith(".tmp") and str(os.getpid()) in suffix for suffix in suffixes)


def test_blocks_saved_to_the_host_tier_leave_before_a_disk_load_refills_them(tmp_path, monkeypatch):
    """One step may evict block B to the host tier and refill it from disk. The
    disk load used to start before the host save copied B out, so the host tier
    could keep the disk's contents under B's old hash: another prompt's K/V
    served later as a prefix hit."""
    pool = caches()
    codec = BlockCodec(pool)
    layout = DiskTierLayout.create(tmp_path, b"f" * 16, codec.block_bytes)
    reports = LoadReports()
    runner = SimpleNamespace(disk_store=DiskKVStore(layout, pool, reports), offload_store=HostKVStore(pool, 4))
    on_disk = b"h" * 32
    runner.disk_store.apply(DiskOps(writes=[(1, on_disk)]))
    assert runner.disk_store.flush()
    old_contents = [cache[:, 5].clone() for cache in pool]
    save = runner.offload_store._save

    def slow_save(*args):
        time.sleep(0.05)  # the loader thread had this long to overwrite block 5 first
        save(*args)

    monkeypatch.setattr(runner.offload_store, "_save", slow_save)
    step = KVTransfers(saves=[(5, 0)], disk=DiskOps(loads=[DiskLoad("r", [(on_disk, 5)])]))
    ModelRunner.apply_kv_transfers(runner, step)
    reports.wait(10)
    assert reports.take() == [("r", [])]
    for cache, store, old in zip(pool, runner.offload_store.store, old_contents):
        assert torch.equal(store[0], old)  # the evicted block's own contents in its slot
        assert torch.equal(cache[:, 5], cache[:, 1])  # and the disk's block in the pool
    runner.disk_store.close()
