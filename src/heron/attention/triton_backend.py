"""Paged attention in Triton: the CUDA backend.

One kernel serves mixed batches: prefill chunks (many query tokens per request,
causal within the chunk, attending to the request's cached pages) and decodes
(one query token) in the same launch. A program handles a tile of one request's
query tokens for one KV head: the rows of its tile are (query token, query head
of the KV head's group) pairs, so grouped-query attention shares each K/V load
across the group. It walks the request's pages through the block table in tiles
of ``TILE_N`` keys, with an online softmax (flash-attention style) in float32.

Split-KV decode ("flash decoding"): a decode-only step with few sequences gives
the kernel few programs (sequences x KV heads: 8 for Llama-3.2-1B at batch 1),
so a long context is walked by a handful of SMs while the rest idle. There the
keys are split into up to ``max_kv_splits`` contiguous spans, one program each;
every program writes its span's normalised output and log-sum-exp in float32,
and a second kernel merges the spans. The number of splits depends only on the
batch's shape (not on its lengths), so a CUDA graph captured for a batch bucket
stays valid; a span of a short sequence may be empty, and then adds nothing.

The work list (which request and which query tile each program takes) is built
on the host once per step; every layer reuses it. The kernel reads this step's
K/V from the cache too: the model writes them there first, fused with RoPE
(``models/layers/triton_ops.rotate_and_store``), or ``forward`` stores them with
``index_copy_`` (torch.compile, callers with ready K/V).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from heron import envs
from heron.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata, BatchLayout
from heron.utils import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the backend is simply unavailable
    triton = None
    tl = None


def triton_available() -> bool:
    """Triton is installed and something can run its kernels: a CUDA device, or
    Triton's CPU interpreter (``TRITON_INTERPRET=1``; how the CPU tests run them)."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_table_ptr, seq_lens_ptr, query_start_loc_ptr, work_seq_ptr, work_q_ptr,
        partial_out_ptr, partial_lse_ptr,
        scale, softcap, sliding_window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        # BLOCK_M >= BLOCK_Q * GROUP rows (a power of two); the extra rows are masked.
        # NUM_SPLITS > 1: program (work, kv head, split) covers one span of the keys and
        # writes partial_out[token, head, split, :] (normalised) and partial_lse[token, head, split]
        work = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(work_seq_ptr + work)
        if seq < 0:
            return  # padding of a fixed-size work list
        q_tile = tl.load(work_q_ptr + work)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len

        rows = tl.arange(0, BLOCK_M)
        q_index = q_tile + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (q_index < q_len)
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dims < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + q_index)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        q_pos = context_len + q_index  # absolute position of each row's query

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
        kv_end = tl.minimum(seq_len, context_len + q_tile + BLOCK_Q)
        kv_start = 0
        if USE_WINDOW:
            kv_start = tl.maximum(0, context_len + q_tile - sliding_window + 1)
            kv_start = (kv_start // TILE_N) * TILE_N
        if NUM_SPLITS > 1:  # this program's span: whole tiles, so spans never share a tile
            split = tl.program_id(2)
            span = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE_N) * TILE_N
            kv_start = kv_start + split * span
            kv_end = tl.minimum(kv_end, kv_start + span)
        for start_n in range(kv_start, kv_end, TILE_N):
            m_i, l_i, acc = _attend_tile(
                q, q_pos, m_i, l_i, acc, start_n, kv_end, seq, kv_head, dims, dim_valid,
                k_cache_ptr, v_cache_ptr, block_table_ptr, scale, softcap, sliding_window,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                BLOCK_SIZE, TILE_N, USE_SOFTCAP, USE_WINDOW, IEEE,
            )
        _store_rows(
            acc, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr, q_start + q_index, head, row_valid,
            dims, dim_valid, stride_ot, stride_oh, GROUP, HEAD_DIM, NUM_SPLITS,
        )

    @triton.jit
    def _attend_tile(
        q, q_pos, m_i, l_i, acc, start_n, kv_end, seq, kv_head, dims, dim_valid,
        k_cache_ptr, v_cache_ptr, block_table_ptr, scale, softcap, sliding_window,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """One tile of ``TILE_N`` keys from ``start_n``: the scores of the rows'
        queries against them (causal, windowed, soft-capped), folded into the
        running max ``m_i``, sum ``l_i`` and output ``acc`` (online softmax)."""
        offs_n = start_n + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_end
        block_ids = tl.load(block_table_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        slots = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + block_ids[None, :].to(tl.int64) * stride_kb + slots[None, :] * stride_ks
            + kv_head * stride_kh + dims[:, None],
            mask=dim_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        # float scalars may arrive as float64 (torch.compile passes them so): keep s float32
        if IEEE:
            s = (tl.dot(q, k, input_precision="ieee") * scale).to(tl.float32)
        else:
            s = (tl.dot(q, k) * scale).to(tl.float32)
        if USE_SOFTCAP:  # softcap * tanh(s / softcap)
            s = (softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)).to(tl.float32)
        keep = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if USE_WINDOW:
            keep = keep & (q_pos[:, None] - offs_n[None, :] < sliding_window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + block_ids[:, None].to(tl.int64) * stride_vb + slots[:, None] * stride_vs
            + kv_head * stride_vh + dims[None, :],
            mask=n_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _store_rows(
        acc, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr, token, head, row_valid, dims, dim_valid,
        stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        """The rows' normalised outputs: into ``out`` at (token, head), or with
        split KV into this program's span of ``partial_out`` with its log-sum-exp."""
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if NUM_SPLITS > 1:
            num_heads = tl.num_programs(1) * GROUP
            partial = (token * num_heads + head) * NUM_SPLITS + tl.program_id(2)
            tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=row_valid[:, None] & dim_valid[None, :])
            # an empty span (or one the mask hides entirely) weighs nothing in the merge
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(partial_lse_ptr + partial, lse, mask=row_valid)
        else:
            tl.store(
                out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=row_valid[:, None] & dim_valid[None, :],
            )

    @triton.jit
    def _merge_kv_splits_kernel(
        out_ptr, partial_out_ptr, partial_lse_ptr, work_seq_ptr, stride_ot, stride_oh,
        NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    ):
        """out[token, head] = the spans' outputs weighted by their softmax mass.
        Decode-only: token ``i`` is work item ``i``; a padded one (no sequence) gets 0."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dims < HEAD_DIM
        if tl.load(work_seq_ptr + token) < 0:  # its spans were never written
            tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
                     tl.zeros([HEAD_DIM_PADDED], tl.float32).to(out_ptr.dtype.element_ty), mask=dim_valid)
            return
        partial = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
        lse = tl.load(partial_lse_ptr + partial)
        top = tl.max(lse, 0)
        weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # empty spans: 0
        spans = tl.load(partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], mask=dim_valid[None, :],
                        other=0.0)
        total = tl.sum(weight, 0)
        merged = tl.sum(spans * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, merged.to(out_ptr.dtype.element_ty),
                 mask=dim_valid)


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    work_seq: torch.Tensor  # [W] int32, -1 for padding
    work_q: torch.Tensor  # [W] int32: first query index of the tile
    block_q: int  # query tokens per tile (per program)
    block_size: int
    max_kv_splits: int = 1  # > 1 only for decode-only steps (see choose_kv_splits)
    num_sms: int = 1  # programs the device runs at once, about: its SM count


DEFAULT_MAX_KV_SPLITS = 16
INTERPRETER_SMS = 8  # a small stand-in device, so the interpreted tests split at small batches


def choose_kv_splits(programs: int, num_sms: int, max_kv_splits: int) -> int:
    """Spans per decode's keys: the largest power of two (at most ``max_kv_splits``)
    for which the split grid still fits in one wave of ``num_sms`` programs; 1 when
    the unsplit grid already fills half the device."""
    splits = 1
    while splits * 2 <= max_kv_splits and programs * splits * 2 <= num_sms:
        splits *= 2
    return splits


def max_kv_splits_setting() -> int:
    """``HERON_ATTENTION_MAX_KV_SPLITS`` (1 turns split-KV decode off)."""
    raw = envs.get(envs.HERON_ATTENTION_MAX_KV_SPLITS, str(DEFAULT_MAX_KV_SPLITS))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1 or value & (value - 1):
        raise ValueError(f"HERON_ATTENTION_MAX_KV_SPLITS must be a power of two >= 1, got {raw!r}")
    return value


def plan_work(query_lens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """One entry per (request, query tile)."""
    tiles = cdiv(query_lens, block_q)
    work_seq = np.repeat(np.arange(len(query_lens), dtype=np.int32), tiles)
    offsets = np.arange(int(tiles.sum()), dtype=np.int32) - np.repeat(np.cumsum(tiles) - tiles, tiles).astype(np.int32)
    return work_seq, offsets * block_q


class TritonAttentionBackend(AttentionBackend[TritonAttentionMetadata]):
    name = "triton"
    attends_from_cache = True

    def __init__(self, num_queries_per_kv: int, max_kv_splits: int | None = None) -> None:
        if not triton_available():
            raise RuntimeError("the triton attention backend needs triton and a CUDA device (or TRITON_INTERPRET=1)")
        self.group = num_queries_per_kv
        self.max_kv_splits = max_kv_splits_setting() if max_kv_splits is None else max_kv_splits
        self._num_sms: dict[torch.device, int] = {}

    def num_sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda" else INTERPRETER_SMS
            )
        return self._num_sms[device]

    def block_q(self, max_query_len: int) -> int:
        """Query tokens per program: 16 rows for decodes (tl.dot's minimum), 64 for prefill."""
        rows = 16 if max_query_len == 1 else 64
        return max(1, rows // self.group)

    def build_metadata(self, layout: BatchLayout) -> TritonAttentionMetadata:
        device = layout.slot_mapping.device
        query_lens = layout.query_lens
        max_query_len = int(query_lens.max())
        block_q = self.block_q(max_query_len)
        work_seq, work_q = plan_work(query_lens, block_q)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).to(device, non_blocking=True)

        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            block_table=to_device(layout.block_table),
            seq_lens=to_device(layout.seq_lens),
            query_start_loc=to_device(layout.query_start_loc),
            work_seq=to_device(work_seq),
            work_q=to_device(work_q),
            block_q=block_q,
            block_size=layout.block_size,
            max_kv_splits=self.max_kv_splits if max_query_len == 1 else 1,
            num_sms=self.num_sms(device),
        )

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        self.store_kv(kv_cache, key, value, metadata.slot_mapping)
        return self.attend_cached(layer, query, kv_cache, metadata)

    def attend_cached(
        self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonAttentionMetadata
    ) -> torch.Tensor:
        output = torch.empty_like(query)
        paged_attention(output, query, kv_cache[0], kv_cache[1], metadata, layer)
        return output


def paged_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: TritonAttentionMetadata,
    layer: AttentionLayerSpec,
) -> None:
    """output[T, H, D] = attention of query[T, H, D] over the paged cache."""
    group = layer.num_heads // layer.num_kv_heads
    head_dim = layer.head_dim
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    num_work = metadata.work_seq.shape[0]
    splits = 1
    if not torch.compiler.is_compiling():  # (compile keeps batch sizes symbolic: a split count would guard on them)
        splits = choose_kv_splits(num_work * layer.num_kv_heads, metadata.num_sms, metadata.max_kv_splits)
    partial_out = partial_lse = output  # unused without splits
    if splits > 1:
        tokens = query.shape[0]
        partial_out = torch.empty((tokens, layer.num_heads, splits, head_dim), dtype=torch.float32, device=query.device)
        partial_lse = torch.empty((tokens, layer.num_heads, splits), dtype=torch.float32, device=query.device)
    _paged_attention_kernel[(num_work, layer.num_kv_heads, splits)](
        output, query, key_cache, value_cache,
        metadata.block_table, metadata.seq_lens, metadata.query_start_loc, metadata.work_seq, metadata.work_q,
        partial_out, partial_lse,
        layer.scale, layer.logits_soft_cap or 0.0, layer.sliding_window or 0,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        metadata.block_table.stride(0),
        GROUP=group,
        BLOCK_SIZE=metadata.block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_Q=metadata.block_q,
        BLOCK_M=max(16, triton.next_power_of_2(metadata.block_q * group)),
        TILE_N=64,
        USE_SOFTCAP=layer.logits_soft_cap is not None,
        USE_WINDOW=layer.sliding_window is not None,
        IEEE=query.dtype == torch.float32,
        NUM_SPLITS=splits,
        num_warps=4,
    )
    if splits > 1:
        _merge_kv_splits_kernel[(query.shape[0], layer.num_heads)](
            output, partial_out, partial_lse, metadata.work_seq, output.stride(0), output.stride(1),
            NUM_SPLITS=splits, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, num_warps=1,
        )
