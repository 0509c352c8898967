"""One pool block's K/V as bytes and back: what the disk tier writes to a file
and what a prefill engine sends a decode engine. The bytes are each attention
layer's ``cache[:, block]`` (K then V), in layer order, as the pool holds them."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockCodec:
    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        """``caches``: every attention layer's pool cache (the draft model's too),
        each ``[2, num_blocks, block_size, heads, head_dim]``."""
        self.caches = list(caches)
        self._sizes = [cache[:, 0].numel() * cache.element_size() for cache in self.caches]
        self.block_bytes = sum(self._sizes)

    def capture(self, block_id: int) -> torch.Tensor:
        """A copy of the block, as a flat uint8 tensor on the CPU."""
        buffer = torch.empty(self.block_bytes, dtype=torch.uint8)
        offset = 0
        for cache, size in zip(self.caches, self._sizes, strict=True):
            block = cache[:, block_id]
            buffer[offset:offset + size].view(block.dtype).view(block.shape).copy_(block)
            offset += size
        return buffer

    def restore(self, payload: torch.Tensor, block_id: int) -> None:
        """Write a captured block (``block_bytes`` uint8) into pool block ``block_id``."""
        offset = 0
        for cache, size in zip(self.caches, self._sizes, strict=True):
            block = cache[:, block_id]
            block.copy_(payload[offset:offset + size].view(block.dtype).view(block.shape))
            offset += size
