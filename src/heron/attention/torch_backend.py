"""Paged attention for the CPU (and, with plain torch ops, a CUDA fallback).

Per step, requests with one query token (decodes) are attended together: on the
CPU by heron's native kernel (``heron.kernels.cpu``), which reads each sequence's K/V in
place through its block table; otherwise in one batched SDPA call over gathered,
padded, masked K/V. Requests with several query tokens (prefill chunks) are
attended one by one, each over its own gathered context with a causal mask; a
prefill with nothing cached attends over its fresh K/V directly (no gather).
Masks are built once per step per sliding-window size and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from heron.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata, BatchLayout
from heron.kernels.cpu import ops as cpu_kernels
from heron.utils import cdiv


@dataclass
class PrefillSpan:
    start: int  # first token in the flat batch
    end: int  # one past the last
    seq_len: int  # context length including this step's tokens
    num_computed: int  # tokens already cached before this step
    block_ids: torch.Tensor  # the blocks covering seq_len, int64


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor
    num_tokens: int
    block_size: int
    decode_token_index: torch.Tensor | None = None  # [num_decodes]
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_block_ids: torch.Tensor | None = None  # the same, flattened
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes]
    all_decode: bool = False  # every token is a decode: no gather/scatter of rows needed
    prefills: list[PrefillSpan] = field(default_factory=list)
    # the step's layout on the host, for token_rows()
    host_layout: BatchLayout | None = None
    # (kind, index, sliding window) -> boolean mask, built on first use
    _masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)
    _token_rows: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Every token of the step as a query row of paged attention (the native
        forward pass attends all of them alike): the requests' block table
        ``[num_reqs, max_blocks]``, each token's row in it (None: token i is
        request i's only one) and each token's context length (position + 1),
        int64 CPU tensors."""
        if self._token_rows is None:
            if self.all_decode:
                assert self.decode_block_table is not None and self.decode_seq_lens is not None
                self._token_rows = (self.decode_block_table, None, self.decode_seq_lens)
            else:
                layout = self.host_layout
                assert layout is not None
                query_lens = layout.query_lens
                rows = np.repeat(np.arange(layout.num_reqs, dtype=np.int64), query_lens)
                first_position = layout.seq_lens - query_lens  # of each request's tokens in this step
                context_lens = (np.arange(layout.num_tokens, dtype=np.int64) - layout.query_start_loc[rows]
                                + first_position[rows] + 1)
                max_blocks = int(cdiv(int(layout.seq_lens.max()), layout.block_size))
                block_table = np.ascontiguousarray(layout.block_table[:, :max_blocks], dtype=np.int64)
                self._token_rows = (torch.from_numpy(block_table), torch.from_numpy(rows),
                                    torch.from_numpy(context_lens))
        return self._token_rows

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        key = ("decode", 0, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_block_table is not None and self.decode_seq_lens is not None
            kv_len = self.decode_block_table.shape[1] * self.block_size
            positions = torch.arange(kv_len, device=self.decode_seq_lens.device)
            seq_lens = self.decode_seq_lens[:, None]
            mask = positions[None, :] < seq_lens
            if sliding_window is not None:
                mask &= positions[None, :] >= seq_lens - sliding_window
            mask = mask[:, None, None, :]  # [num_decodes, 1 (heads), 1 (query), kv_len]
            self._masks[key] = mask
        return mask

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """Causal (and windowed) mask of one prefill span; None means "plain causal
        over fresh K/V" and lets SDPA use its is_causal fast path."""
        span = self.prefills[index]
        if span.num_computed == 0 and sliding_window is None:
            return None
        key = ("prefill", index, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            device = span.block_ids.device
            query_pos = torch.arange(span.num_computed, span.seq_len, device=device)[:, None]
            key_pos = torch.arange(span.seq_len, device=device)[None, :]
            mask = key_pos <= query_pos
            if sliding_window is not None:
                mask &= key_pos > query_pos - sliding_window
            self._masks[key] = mask
        return mask


class TorchAttentionBackend(AttentionBackend[TorchAttentionMetadata]):
    name = "torch"

    def build_metadata(self, layout: BatchLayout) -> TorchAttentionMetadata:
        device = layout.slot_mapping.device
        query_lens = layout.query_lens
        metadata = TorchAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            num_tokens=layout.num_tokens,
            block_size=layout.block_size,
            host_layout=layout,
        )
        decode_rows = np.flatnonzero(query_lens == 1)
        if decode_rows.size:
            seq_lens = layout.seq_lens[decode_rows]
            max_blocks = int(cdiv(seq_lens.max(), layout.block_size))
            metadata.decode_token_index = torch.from_numpy(
                layout.query_start_loc[decode_rows].astype(np.int64)
            ).to(device)
            metadata.decode_block_table = torch.from_numpy(
                layout.block_table[decode_rows, :max_blocks].astype(np.int64)
            ).to(device)
            metadata.decode_block_ids = metadata.decode_block_table.flatten()
            metadata.decode_seq_lens = torch.from_numpy(seq_lens.astype(np.int64)).to(device)
            metadata.all_decode = decode_rows.size == layout.num_reqs
        for row in np.flatnonzero(query_lens > 1):
            seq_len = int(layout.seq_lens[row])
            num_blocks = cdiv(seq_len, layout.block_size)
            metadata.prefills.append(
                PrefillSpan(
                    start=int(layout.query_start_loc[row]),
                    end=int(layout.query_start_loc[row + 1]),
                    seq_len=seq_len,
                    num_computed=seq_len - int(query_lens[row]),
                    block_ids=torch.from_numpy(
                        layout.block_table[row, :num_blocks].astype(np.int64)
                    ).to(device),
                )
            )
        return metadata

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [blocks, block_size, heads, dim]
        self.store_kv(kv_cache, key, value, metadata.slot_mapping)

        if metadata.decode_token_index is not None:
            q = query if metadata.all_decode else query.index_select(0, metadata.decode_token_index)
            if layer.logits_soft_cap is None and cpu_kernels.can_run_paged_decode(q, kv_cache):
                assert metadata.decode_block_table is not None and metadata.decode_seq_lens is not None
                attended = cpu_kernels.paged_decode_attention(
                    q,
                    kv_cache,
                    metadata.decode_block_table,
                    metadata.decode_seq_lens,
                    layer.scale,
                    layer.sliding_window,
                )
            else:
                attended = self._decode_with_torch(layer, q, kv_cache, metadata)
            if metadata.all_decode:
                return attended
            output = torch.empty_like(query)
            output.index_copy_(0, metadata.decode_token_index, attended)
        else:
            output = torch.empty_like(query)
        for index, span in enumerate(metadata.prefills):
            q = query[span.start : span.end].transpose(0, 1)  # [H, Q, D]
            mask = metadata.prefill_mask(index, layer.sliding_window)
            if span.num_computed == 0:
                k = key[span.start : span.end]
                v = value[span.start : span.end]
            else:
                k = key_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[: span.seq_len].to(query.dtype)
                v = value_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[: span.seq_len].to(query.dtype)
            attended = _attend(layer, q, k.transpose(0, 1), v.transpose(0, 1), mask)
            output[span.start : span.end] = attended.transpose(0, 1)
        return output

    @staticmethod
    def _decode_with_torch(
        layer: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata
    ) -> torch.Tensor:
        """Decodes by gathering their blocks into a padded, masked batch (one SDPA)."""
        assert metadata.decode_block_ids is not None
        num_decodes = q.shape[0]
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        # K and V of every decode's blocks in one row gather: [2, B, L, Hkv, D]
        kv = (
            kv_cache.view(2, kv_cache.shape[1], -1)
            .index_select(1, metadata.decode_block_ids)
            .view(2, num_decodes, -1, num_kv_heads, head_dim)
            .to(q.dtype)
        )
        # each KV head's query heads become query rows: [B, Hkv, group, D]
        return _attend(
            layer,
            q.view(num_decodes, num_kv_heads, layer.num_heads // num_kv_heads, head_dim),
            kv[0].transpose(1, 2),
            kv[1].transpose(1, 2),
            metadata.decode_mask(layer.sliding_window),
            grouped=True,
        ).reshape(num_decodes, layer.num_heads, head_dim)


def _attend(
    layer: AttentionLayerSpec,
    query: torch.Tensor,  # [..., H, Q, D], or [..., Hkv, group, D] when grouped
    key: torch.Tensor,  # [..., Hkv, K, D]
    value: torch.Tensor,
    mask: torch.Tensor | None,  # broadcastable to [..., H, Q, K]; None = causal
    grouped: bool = False,
) -> torch.Tensor:
    """Attention of ``query`` over ``key``/``value``. ``grouped`` (decodes only):
    the query rows of each KV head are its group's heads, so no K/V repetition."""
    expand = layer.num_kv_heads != layer.num_heads and not grouped
    if layer.logits_soft_cap is None:
        if query.dim() == 3:
            # torch's fused CPU attention kernel takes 4-D inputs only (3-D ones fall
            # back to the unfused math path, ~3x slower for a 250-token prefill)
            query, key, value = query[None], key[None], value[None]
            squeeze = True
        else:
            squeeze = False
        attended = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=layer.scale, enable_gqa=expand
        )
        return attended[0] if squeeze else attended
    # Soft-capped scores (Gemma 2 style) are not supported by SDPA: do it by hand.
    if expand:
        group = layer.num_heads // layer.num_kv_heads
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * layer.scale
    scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
    if mask is None:
        q_len, k_len = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(value.dtype), value)
