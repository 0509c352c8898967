"""Pool blocks' K/V as bytes and back: what the disk tier writes to a file
and what a prefill engine sends a decode engine. The bytes are each attention
layer's ``cache[:, block]`` (K then V), in layer order, as the pool holds them.

Blocks go many at once, a copy or two per layer rather than one per block and
layer: a 2,000-token prompt's 123 blocks over 30 layers were 3,690 small
copies, each a Python call holding the GIL (in the step loop for writes; on a
background thread for loads and pulls, where the step loop waited for the
GIL): 59-97 ms for 123 blocks against 13-51 ms, mostly in copies that
release it (BENCHMARKS.md, "A disk tier on a network file system")."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockCodec:
    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        """``caches``: every attention layer's pool cache (the draft model's too),
        each ``[2, num_blocks, block_size, heads, head_dim]``."""
        self.caches = list(caches)
        # (cache, byte offset of its part in a block's bytes, bytes of that part), per layer
        self._layers: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        for cache in self.caches:
            size = cache[:, 0].numel() * cache.element_size()
            self._layers.append((cache, offset, size))
            offset += size
        self.block_bytes = offset

    def capture(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copies of the blocks, one row each: ``[len(block_ids), block_bytes]`` uint8."""
        buffer = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8)
        indexes = self._indexes(block_ids)
        for cache, offset, size in self._layers:
            self._rows(buffer, cache, offset, size).copy_(cache.index_select(1, indexes[cache.device]))
        return buffer

    def restore(self, payloads: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write captured blocks (rows of ``[len(block_ids), block_bytes]`` uint8 on
        the host, each row contiguous) into pool blocks ``block_ids``."""
        indexes = self._indexes(block_ids)
        for cache, offset, size in self._layers:
            rows = self._rows(payloads, cache, offset, size)
            cache.index_copy_(1, indexes[cache.device], rows.to(cache.device))

    def _indexes(self, block_ids: Sequence[int]) -> dict[torch.device, torch.Tensor]:
        """The block ids as an index on each device the caches are on (a GPU
        pool's index_select and index_copy_ take no index from the host)."""
        index = torch.tensor(block_ids, dtype=torch.long)
        return {device: index.to(device) for device in {cache.device for cache in self.caches}}

    @staticmethod
    def _rows(buffer: torch.Tensor, cache: torch.Tensor, offset: int, size: int) -> torch.Tensor:
        """One layer's part of each row of ``buffer``, as ``[2, rows, *block]`` like ``cache[:, ids]``."""
        part = buffer[:, offset:offset + size].view(cache.dtype)
        return part.view(buffer.shape[0], 2, *cache.shape[2:]).transpose(0, 1)
