"""The worker's half of a KV offload tier (``core/kv_offload.py``): the tier's
memory, one tensor per attention layer holding ``num_slots`` blocks, and the
copies between it and the pool. On the CPU the tier is a second, larger store
in RAM (allocated lazily: pages cost nothing until a block is saved there). On
CUDA it is pinned host memory, so blocks move by DMA without the host waiting.

A slot's K/V are contiguous in the tier (``[num_slots, 2, block_size, heads,
head_dim]`` per layer, slot-major, unlike the pool's ``[2, num_blocks, ...]``),
so a run of consecutive slots is one contiguous range: on CUDA each run is one
copy per layer straight between the pinned tier and a gathered device tensor,
and the scatter into pool blocks happens on the device. The tier hands out
slots in order, so a prefix's blocks are usually one run, and then every copy
is queued on the current stream, ahead of the forward pass that reads the
loaded blocks and the one that overwrites the saved ones: nothing waits. Slots
scattered over many runs go through pinned staging instead, where the host
gathers or scatters them.

The one rule the host keeps on CUDA: it touches the tier's bytes itself only
after every queued copy that writes them has run. A staged save waits for the
stream before it scatters; a staged load waits for the last queued save
(``_saves_queued``), which may have written the very slots it gathers, this
step or an earlier one still queued behind a forward pass."""

from __future__ import annotations

import weakref

import torch

from heron.core.kv_offload import KVTransfers


class HostKVStore:
    def __init__(self, caches: list[torch.Tensor], num_slots: int) -> None:
        """``caches``: every attention layer's pool cache (the draft model's too),
        each ``[2, num_blocks, block_size, heads, head_dim]``. On CUDA the tier
        is page-locked at once; a tier that cannot be is refused with the
        reason (rather than served with copies that each wait for the host)."""
        self.caches = caches
        # on CUDA the tier is page-locked (or refused); on the CPU it is plain RAM
        self.pinned = bool(caches) and caches[0].device.type == "cuda"
        shapes = [(num_slots, cache.shape[0], *cache.shape[2:]) for cache in caches]
        sizes = [torch.Size(shape).numel() * cache.element_size() for shape, cache in zip(shapes, caches, strict=True)]
        try:
            backing = torch.empty(sum(sizes), dtype=torch.uint8)
        except RuntimeError as exc:  # the allocator's own message names no option
            raise ValueError(f"kv_offloading_size: cannot allocate the host tier of {sum(sizes) / (1 << 30):.1f} "
                             f"GiB ({str(exc).splitlines()[0]})") from exc
        if self.pinned:
            _pin(self, backing, caches[0].device)
        self.store: list[torch.Tensor] = []
        offset = 0
        for shape, size, cache in zip(shapes, sizes, caches, strict=True):
            self.store.append(backing[offset:offset + size].view(cache.dtype).view(shape))
            offset += size
        # the stream position after the last saves queued into the tier (CUDA)
        self._saves_queued: torch.cuda.Event | None = None

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> None:
        """Saves first (a block evicted and refilled in one step keeps its old
        contents in the tier), then loads."""
        if transfers.saves:
            block_ids, slots = (list(column) for column in zip(*transfers.saves, strict=True))
            self._save(block_ids, slots)
        if transfers.loads:
            slots, block_ids = (list(column) for column in zip(*transfers.loads, strict=True))
            self._load(slots, block_ids)

    def _save(self, block_ids: list[int], slots: list[int]) -> None:
        slot_index = torch.tensor(slots)
        if not self.pinned:
            block_index = torch.tensor(block_ids)
            for cache, store in zip(self.caches, self.store, strict=True):
                store.index_copy_(0, slot_index, _gather(cache, block_index))
            return
        block_index = _device_index(block_ids, self.caches[0].device)
        runs = _runs(slots)
        if _scattered(runs, slots):
            self._save_through_staging(block_index, slot_index)
            return
        for cache, store in zip(self.caches, self.store, strict=True):
            rows = _gather(cache, block_index)
            for first, slot, count in runs:
                store[slot:slot + count].copy_(rows[first:first + count], non_blocking=True)
        self._saves_queued = torch.cuda.Event()
        self._saves_queued.record(torch.cuda.current_stream(self.caches[0].device))

    def _save_through_staging(self, block_index: torch.Tensor, slot_index: torch.Tensor) -> None:
        """Scattered slots: every layer's blocks down to pinned staging in one
        copy each, a wait for the stream (so every copy queued before, into the
        tier or out of it, has run too), then the host scatters them."""
        staged = []
        for cache in self.caches:
            rows = _gather(cache, block_index)
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            staged.append(host)
        torch.cuda.current_stream(self.caches[0].device).synchronize()
        for store, host in zip(self.store, staged, strict=True):
            store.index_copy_(0, slot_index, host)

    def _load(self, slots: list[int], block_ids: list[int]) -> None:
        slot_index = torch.tensor(slots)
        if not self.pinned:
            block_index = torch.tensor(block_ids)
            for cache, store in zip(self.caches, self.store, strict=True):
                cache.index_copy_(1, block_index, store.index_select(0, slot_index).transpose(0, 1))
            return
        block_index = _device_index(block_ids, self.caches[0].device)
        runs = _runs(slots)
        scattered = _scattered(runs, slots)
        if scattered and self._saves_queued is not None:
            self._saves_queued.synchronize()  # the host reads slots those saves may be writing
        for cache, store in zip(self.caches, self.store, strict=True):
            if scattered:  # the host gathers the slots into pinned staging: one upload per layer
                host = torch.empty((len(slots), *store.shape[1:]), dtype=store.dtype, pin_memory=True)
                torch.index_select(store, 0, slot_index, out=host)
                rows = host.to(cache.device, non_blocking=True)
            else:
                rows = torch.empty((len(slots), *store.shape[1:]), dtype=store.dtype, device=cache.device)
                for first, slot, count in runs:
                    rows[first:first + count].copy_(store[slot:slot + count], non_blocking=True)
            cache.index_copy_(1, block_index, rows.transpose(0, 1))


def _gather(cache: torch.Tensor, block_index: torch.Tensor) -> torch.Tensor:
    """The blocks' K/V slot-major, ``[len(block_index), 2, block_size, heads, head_dim]``, contiguous."""
    return cache.transpose(0, 1).index_select(0, block_index)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive slots: (index of the run's first entry, its first slot, length)."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((index, slot, 1))
    return runs


def _scattered(runs: list[tuple[int, int, int]], slots: list[int]) -> bool:
    """Too many runs for a copy each (about 6 us per copy and layer on an H200):
    a host gather through pinned staging is cheaper once runs pass half the blocks."""
    return len(runs) > max(4, len(slots) // 2)


def _device_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index on ``device``, uploaded from pinned memory without a wait."""
    return torch.tensor(block_ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)


def _pin(owner: object, backing: torch.Tensor, device: torch.device) -> None:
    """Page-lock ``backing`` in place (cudaHostRegister: exactly its size, where
    torch's pinned allocator would round a tier up to a power of two) until
    ``owner`` is collected; then the device finishes its queued copies before
    the pages are unlocked. A failure is raised: the runtime keeps it as its
    last error, which torch's next launch check would report from an unrelated
    kernel, so the engine must not go on."""
    cudart = torch.cuda.cudart()
    pointer, size = backing.data_ptr(), backing.numel()
    error = cudart.cudaHostRegister(pointer, size, 0)
    if int(error) != 0:
        reason = getattr(cudart, "cudaGetErrorString", str)(error)
        raise RuntimeError(f"could not page-lock the {size / (1 << 30):.2f} GiB host KV tier ({reason}): "
                           "lower --kv-offloading-size, or raise the locked-memory limit (ulimit -l)")

    def unpin() -> None:
        torch.cuda.synchronize(device)
        cudart.cudaHostUnregister(pointer)

    weakref.finalize(owner, unpin)
