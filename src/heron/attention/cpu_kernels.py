"""heron's native CPU kernels: small C files compiled with the system C compiler
on first use (about a second), cached, and called through ctypes.

They need no torch headers: kernels take raw pointers to contiguous tensors.
OpenMP threading shares torch's runtime (torch's CPU build loads ``libgomp.so.1``
first, and the kernel library links the same soname). Without a C compiler the
kernels are unavailable and callers fall back to torch ops; set
``HERON_DISABLE_NATIVE=1`` to force that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources

import torch

logger = logging.getLogger(__name__)

_SOURCES = ("paged_attention.c", "lowbit_input.c", "tiled_linear.c", "llama_decode.c")
_HEADERS = ("lowbit_input.h",)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_MAX_HEADS = 256  # the paged kernel's per-task arrays hold up to this many query heads


def _cache_dir() -> str:
    base = os.environ.get("HERON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "heron")
    return os.path.join(base, "kernels")


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (logged once) when it cannot be built."""
    if os.environ.get("HERON_DISABLE_NATIVE"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: native CPU kernels disabled (slower torch fallbacks)")
        return None
    sources = [resources.files("heron.attention").joinpath("csrc", name) for name in _SOURCES]
    headers = [resources.files("heron.attention").joinpath("csrc", name) for name in _HEADERS]
    digest = hashlib.sha256()
    for source in sources + headers:
        digest.update(source.read_bytes())
    digest.update(" ".join([compiler, *_FLAGS]).encode())
    target_dir = os.path.join(_cache_dir(), digest.hexdigest()[:16])
    target = os.path.join(target_dir, "libheron_cpu.so")
    if not os.path.exists(target):
        os.makedirs(target_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as scratch:
            paths = []
            for source in sources + headers:
                path = os.path.join(scratch, source.name)
                with open(path, "wb") as handle:
                    handle.write(source.read_bytes())
                if source in sources:
                    paths.append(path)
            partial = os.path.join(scratch, "libheron_cpu.so")
            result = subprocess.run([compiler, *_FLAGS, *paths, "-o", partial, "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building native CPU kernels failed; using torch fallbacks:\n%s", result.stderr[-2000:])
                return None
            os.replace(partial, target)  # atomic: concurrent builders never see half a file
    library = ctypes.CDLL(target)
    function = library.heron_paged_decode_attention_f32
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int64]
    q4 = library.heron_q4_linear_f32
    q4.restype = ctypes.c_int
    q4.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    q8 = library.heron_q8_linear_f32
    q8.restype = ctypes.c_int
    q8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    rounding = library.heron_round_q8_f32
    rounding.restype = ctypes.c_int
    rounding.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return library


def can_run_paged_decode(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and query.shape[1] <= _MAX_HEADS
        and native_library() is not None
    )


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] float32
    block_table: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    library = native_library()
    assert library is not None
    query = query.contiguous()
    block_table = block_table.contiguous()
    output = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    status = library.heron_paged_decode_attention_f32(
        output.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, block_table.shape[1],
        scale, sliding_window or 0,
    )
    if status != 0:
        raise MemoryError("paged decode attention could not allocate its score buffer")
    return output


def _lowbit_linear(function: str, x: torch.Tensor, n_out: int, *weight: torch.Tensor) -> torch.Tensor:
    """Run one of csrc/tiled_linear.c's kernels: (x, rows, k, *weight pointers, y, n)."""
    library = native_library()
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
) -> torch.Tensor:
    """``Q8(x) @ W^T`` for 4-bit block-quantized ``W`` in column tiles (see csrc/tiled_linear.c)."""
    return _lowbit_linear("heron_q4_linear_f32", x, tiles.shape[0] * 8, tiles, scales, mins)


def q8_linear(
    x: torch.Tensor,  # [rows, k] float32, contiguous
    tiles: torch.Tensor,  # [n / 8, k / 4, 32] int8: weights in column tiles
    column_scales: torch.Tensor,  # [n] float32
) -> torch.Tensor:
    """``Q8(x) @ (W * column_scales)^T`` for int8 ``W`` in column tiles (see csrc/tiled_linear.c)."""
    return _lowbit_linear("heron_q8_linear_f32", x, tiles.shape[0] * 8, tiles, column_scales)


def round_q8(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, k] float32 rounded to int8 in blocks of 16, as ``q4_linear`` rounds its input."""
    library = native_library()
    assert library is not None
    x = x.contiguous()
    out = torch.empty_like(x)
    if library.heron_round_q8_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()) != 0:
        raise ValueError(f"rounding needs a multiple of 32 inputs, got {x.shape[1]}")
    return out
