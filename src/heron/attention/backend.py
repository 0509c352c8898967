"""The attention-backend interface (docs/architecture.md, "Attention").

A backend does two things for every attention layer of a step: store the step's
new K/V into their paged slots, then attend each request's queries over that
request's cached K/V, causally within its new tokens. What it needs beyond the
tensors is described once per step by ``BatchLayout`` (backend-independent, built
by the model runner) and turned into backend-specific metadata by
``build_metadata``; all layers share that metadata.

KV-cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V), so token ``i`` of a request lives at slot
``block_table[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch


@dataclass
class BatchLayout:
    """The flat batch of one step, as attention needs it.

    ``query_start_loc[i]:query_start_loc[i+1]`` are request ``i``'s tokens in the
    flat batch; ``seq_lens[i]`` is its context length once this step's tokens are
    added; ``block_table[i]`` lists its blocks (padded with 0).
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: np.ndarray  # int64 [num_reqs + 1], host
    seq_lens: np.ndarray  # int64 [num_reqs], host
    block_table: np.ndarray  # int32 [num_reqs, max_blocks_per_req], host
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the device
    block_size: int
    host_slot_mapping: np.ndarray | None = None  # the same, on the host

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


def positions_and_slots(
    query_start_loc: np.ndarray, starts: np.ndarray, counts: np.ndarray, block_table: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """For a flat batch where request ``i`` contributes ``counts[i]`` tokens from
    position ``starts[i]`` on: each token's position and its cache slot
    (``block_table[i][pos // B] * B + pos % B``)."""
    num_tokens = int(query_start_loc[-1])
    row_of_token = np.repeat(np.arange(len(counts)), counts)
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - starts, counts)
    slots = block_table[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return positions, slots


def flat_batch_layout(
    starts: np.ndarray, counts: np.ndarray, block_table: np.ndarray, block_size: int, device: torch.device | None
) -> tuple[BatchLayout, np.ndarray]:
    """The layout of a flat batch where request ``i`` contributes ``counts[i]``
    tokens from position ``starts[i]`` on, and each token's position. The slot
    mapping is copied to ``device`` without waiting for it; with ``device`` None
    it stays on the host only (``slot_mapping`` empty) until the caller decides."""
    query_start_loc = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    positions, slots = positions_and_slots(query_start_loc, starts, counts, block_table, block_size)
    layout = BatchLayout(
        num_reqs=len(counts),
        num_tokens=int(query_start_loc[-1]),
        query_start_loc=query_start_loc,
        seq_lens=starts + counts,
        block_table=block_table,
        slot_mapping=torch.empty(0) if device is None else torch.from_numpy(slots).to(device, non_blocking=True),
        block_size=block_size,
        host_slot_mapping=slots,
    )
    return layout, positions


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Per-layer constants a backend needs."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None


class AttentionMetadata:
    """A backend's metadata for one step, built once from the ``BatchLayout``
    and shared by every layer. Each backend subclasses it; all of them carry the
    flat batch's cache slots."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, on the device


MetadataT = TypeVar("MetadataT", bound=AttentionMetadata)


class AttentionBackend(ABC, Generic[MetadataT]):
    name: str = "abstract"
    # True when attention reads this step's K/V from the cache (never from the
    # key/value arguments): the model may then write them there itself, fused
    # with RoPE, and call ``attend_cached``
    attends_from_cache: bool = False

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def store_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys and values (``[num_tokens, num_kv_heads,
        head_dim]``) into their slots of a ``kv_cache_shape`` cache."""
        if key.shape[1:] != kv_cache.shape[3:]:  # a view by the key's shape scrambled the cache: wrong tokens
            raise ValueError(f"keys of {tuple(key.shape[1:])} (heads, dimensions) for a KV cache of "
                             f"{tuple(kv_cache.shape[3:])}: the model's config does not describe its attention")
        flat = kv_cache.view(2, -1, key.shape[1], key.shape[2])
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))  # (a no-op unless the cache has its own dtype)
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> MetadataT:
        """Derive this backend's per-step metadata from the batch layout."""

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: MetadataT,
    ) -> torch.Tensor:
        """Store key/value into the cache, then return the attention output,
        ``[num_tokens, num_heads, head_dim]``."""

    def attend_cached(
        self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor, metadata: MetadataT
    ) -> torch.Tensor:
        """Attention output of ``query`` when this step's K/V are already in
        ``kv_cache`` (backends with ``attends_from_cache`` only)."""
        raise NotImplementedError(f"the {self.name} backend attends over the key/value it is given")

