"""The worker's half of a KV offload tier (``core/kv_offload.py``): the tier's
memory, one tensor per attention layer shaped like the pool's cache with
``num_slots`` blocks, and the copies between the two. On CUDA the tier is
pinned host memory; on the CPU it is a second, larger store in RAM (allocated
lazily: pages cost nothing until a block is saved there)."""

from __future__ import annotations

import torch

from heron.core.kv_offload import KVTransfers


class HostKVStore:
    def __init__(self, caches: list[torch.Tensor], num_slots: int) -> None:
        """``caches``: every attention layer's pool cache (the draft model's too),
        each ``[2, num_blocks, block_size, heads, head_dim]``."""
        self.caches = caches
        pin = bool(caches) and caches[0].device.type == "cuda"
        self.store = [torch.empty((cache.shape[0], num_slots, *cache.shape[2:]), dtype=cache.dtype,
                                  pin_memory=pin) for cache in caches]

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> None:
        """Saves first (a block evicted and refilled in one step keeps its old
        contents in the tier), then loads."""
        if transfers.saves:
            block_ids, slots = (list(column) for column in zip(*transfers.saves, strict=True))
            for cache, store in zip(self.caches, self.store, strict=True):
                store[:, slots] = cache[:, block_ids].to("cpu")
        if transfers.loads:
            slots, block_ids = (list(column) for column in zip(*transfers.loads, strict=True))
            for cache, store in zip(self.caches, self.store, strict=True):
                cache[:, block_ids] = store[:, slots].to(cache.device, non_blocking=True)
