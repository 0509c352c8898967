"""heron's CPU kernels as torch functions: paged decode attention and the
low-bit linear layers (``csrc/``), on the library ``library.native_library()``
loads, or on the one passed as ``library`` (the tests run every build).

Callers check ``native_library() is not None`` (or ``can_run_paged_decode``)
before calling: without a C compiler there are no kernels.
"""

from __future__ import annotations

import ctypes

import torch

from heron.kernels.cpu.library import native_library
from heron.utils import cdiv

_MAX_HEADS = 256  # the paged kernel's per-task arrays hold up to this many query heads


def supports_paged_decode(dtype: torch.dtype, num_heads: int) -> bool:
    """Whether the paged decode kernel covers a model's attention (float32, at most
    ``_MAX_HEADS`` query heads) on this machine (the kernels are built)."""
    return dtype == torch.float32 and num_heads <= _MAX_HEADS and native_library() is not None


def supports_paged_kv_cache(kv_cache_dtype: torch.dtype) -> bool:
    """Whether the paged decode kernel reads a KV cache of this dtype."""
    return kv_cache_dtype in (torch.float32, torch.float16)


def can_run_paged_decode(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and supports_paged_kv_cache(kv_cache.dtype)
        and supports_paged_decode(query.dtype, query.shape[1])
    )


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] float32 or float16
    block_table: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
    sliding_window: int | None,
    library: ctypes.CDLL | None = None,
    table_rows: torch.Tensor | None = None,  # [B] int64: each query row's block-table row (None: row i)
) -> torch.Tensor:
    """Each query row over its request's cached K/V, up to ``seq_lens`` (its own
    position + 1): a decode, or one token of a prefill chunk whose K/V is cached."""
    library = library or native_library()
    assert library is not None
    query = query.contiguous()
    block_table = block_table.contiguous()
    table_rows = None if table_rows is None else table_rows.contiguous()  # held until the call returns
    output = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    status = library.heron_paged_attention_f32(
        output.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(),
        None if table_rows is None else table_rows.data_ptr(), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, block_table.shape[1],
        scale, sliding_window or 0, int(kv_cache.dtype == torch.float16),
    )
    if status != 0:
        raise MemoryError("paged attention could not allocate its score buffer")
    return output


def _lowbit_linear(
    function: str, x: torch.Tensor, n_out: int, *weight: torch.Tensor, library: ctypes.CDLL | None
) -> torch.Tensor:
    """Run one of csrc/tiled_linear.c's kernels: (x, rows, k, *weight pointers, y, n)."""
    library = library or native_library()
    assert library is not None
    assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2, "the kernels take contiguous float32 rows"
    rows, k = x.shape
    out = torch.empty(rows, n_out, dtype=torch.float32)
    status = getattr(library, function)(x.data_ptr(), rows, k, *(w.data_ptr() for w in weight), out.data_ptr(), n_out)
    if status != 0:
        raise RuntimeError(f"{function} failed (status {status})")
    return out


def q4_linear(
    x: torch.Tensor,  # [rows, k] float32, contiguous
    tiles: torch.Tensor,  # [n / 8, k / 32, 128] uint8: 4-bit weights in column tiles
    scales: torch.Tensor,  # [n / 8, k / 32, 8] float32
    mins: torch.Tensor,  # [n / 8, k / 32, 8] float32
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``Q8(x) @ W^T`` for 4-bit block-quantized ``W`` in column tiles (see csrc/tiled_linear.c)."""
    return _lowbit_linear("heron_q4_linear_f32", x, tiles.shape[0] * 8, tiles, scales, mins, library=library)


def q8_linear(
    x: torch.Tensor,  # [rows, k] float32, contiguous
    tiles: torch.Tensor,  # [n / 8, k / 4, 32] int8: weights in column tiles
    column_scales: torch.Tensor,  # [n] float32
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``Q8(x) @ (W * column_scales)^T`` for int8 ``W`` in column tiles (see csrc/tiled_linear.c)."""
    return _lowbit_linear("heron_q8_linear_f32", x, tiles.shape[0] * 8, tiles, column_scales, library=library)


def round_q8(x: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x`` [rows, k] float32 rounded to int8 in blocks of 16, as ``q4_linear`` rounds its input."""
    library = library or native_library()
    assert library is not None
    x = x.contiguous()
    out = torch.empty_like(x)
    if library.heron_round_q8_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()) != 0:
        raise ValueError(f"rounding needs a multiple of 32 inputs, got {x.shape[1]}")
    return out


def to_half(x: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x`` float32 as float16, rounded as the native forward pass writes a float16 KV cache."""
    library = library or native_library()
    assert library is not None
    x = x.detach().float().contiguous()
    out = torch.empty(x.shape, dtype=torch.float16)
    library.heron_store_halves_f32(out.data_ptr(), x.data_ptr(), x.numel())
    return out


def pack_q4_tiles(
    weight: torch.Tensor, library: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [n, k] float32 in the int4 layers' column tiles (Q4_1 rule per
    block of 32): tiles [ceil(n / 8), k / 32, 128] uint8, scales and mins
    [ceil(n / 8), k / 32, 8] float32 (see csrc/quantize_weights.c)."""
    library = library or native_library()
    assert library is not None
    weight = weight.detach().float().contiguous()
    n, k = weight.shape
    num_tiles = cdiv(n, 8)
    tiles = torch.empty(num_tiles, k // 32, 128, dtype=torch.uint8)
    scales = torch.empty(num_tiles, k // 32, 8, dtype=torch.float32)
    mins = torch.empty_like(scales)
    if library.heron_pack_q4_tiles(weight.data_ptr(), n, k, tiles.data_ptr(), scales.data_ptr(), mins.data_ptr()) != 0:
        raise ValueError(f"int4 packing needs a multiple of 32 inputs, got {k}")
    return tiles, scales, mins


def pack_q8_tiles(weight: torch.Tensor, library: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [n, k] float32 in the int8 layers' column tiles (one scale per
    output row): tiles [ceil(n / 8), k / 4, 8, 4] int8 (a tile's 8 columns x 4
    inputs per group) and scales [ceil(n / 8) * 8] float32 (see csrc/quantize_weights.c)."""
    library = library or native_library()
    assert library is not None
    weight = weight.detach().float().contiguous()
    n, k = weight.shape
    num_tiles = cdiv(n, 8)
    tiles = torch.empty(num_tiles, k // 4, 8, 4, dtype=torch.int8)
    scales = torch.empty(num_tiles * 8, dtype=torch.float32)
    if library.heron_pack_q8_tiles(weight.data_ptr(), n, k, tiles.data_ptr(), scales.data_ptr()) != 0:
        raise ValueError(f"int8 packing needs a multiple of 4 inputs, got {k}")
    return tiles, scales
