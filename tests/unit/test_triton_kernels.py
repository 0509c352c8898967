"""heron's Triton kernels against the torch code they replace, on whatever can
run them: a CUDA device when present, otherwise Triton's CPU interpreter (set up
by tests/conftest.py), so CI checks the kernels' logic without a GPU.

The kernels must round where the torch code rounds, so in float16 (and in
bfloat16 on CUDA) at most 0.5% of elements differ from it, each by one
ulp; a kernel that skipped one of the torch code's roundings
differs in percents of its elements. The interpreter rounds float32 ->
bfloat16 by truncation where a GPU rounds to nearest, so there bfloat16 is
only checked to be close; float32 agrees within a few ulps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from heron.attention.backend import AttentionLayerSpec
from heron.models.layers.attention import split_and_rotate
from heron.models.layers.norm import RMSNorm
from heron.models.layers.rotary import RotaryEmbedding

triton = pytest.importorskip("triton")
triton_ops = pytest.importorskip("heron.models.layers.triton_ops")

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("Triton kernels need a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    dtype = got.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    elif dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter truncates
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    else:
        ulp = torch.finfo(dtype).eps  # relative spacing of 1.0; at most one ulp of any value
        torch.testing.assert_close(got.float(), expected.float(), rtol=ulp, atol=ulp * 1e-2)
        mismatched = int((got != expected).sum())
        assert mismatched <= max(1, got.numel() // 200), (
            f"{mismatched} of {got.numel()} elements differ from the torch path")


def random(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(dtype).to(DEVICE)


def torch_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The module's torch path (the kernel is what it calls on CUDA)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)
    return norm.weight * normed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    norm.weight.data = 1 + random((hidden,), dtype, seed=1, scale=0.1)
    x, residual = random((7, hidden), dtype, seed=2), random((7, hidden), dtype, seed=3)
    out, no_residual = triton_ops.rms_norm(x, norm.weight, norm.eps)
    assert no_residual is None
    assert_close(out, torch_rms_norm(norm, x))
    out, summed = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
    assert summed is not None
    assert_close(summed, x + residual)
    assert_close(out, torch_rms_norm(norm, x + residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 1000, 2500])
def test_silu_and_mul(dtype, width):
    gate_up = random((16, 2 * width), dtype, seed=4, scale=3.0)
    gate, up = gate_up.split(width, dim=-1)
    assert_close(triton_ops.silu_and_mul(gate_up), F.silu(gate) * up)
    assert triton_ops.silu_and_mul(gate_up[:0]).shape == (0, width)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, qk_norm",
    [(4, 2, 64, False), (9, 3, 64, False), (8, 2, 128, False), (4, 4, 80, False), (4, 2, 32, True)],
)
def test_rotate_and_store_matches_torch_path(dtype, num_heads, num_kv_heads, head_dim, qk_norm):
    num_tokens, block_size, num_blocks = 9, 16, 6
    spec = AttentionLayerSpec(0, num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    rotary = RotaryEmbedding(head_dim, 256, {"rope_theta": 10000.0}).to(DEVICE)
    positions = torch.tensor([0, 1, 15, 16, 17, 40, 99, 200, 255], device=DEVICE)
    rope = rotary.tables(positions, dtype)
    qkv = random((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype, seed=5)
    norms = None
    if qk_norm:
        norms = (RMSNorm(head_dim, 1e-6).to(DEVICE, dtype), RMSNorm(head_dim, 1e-6).to(DEVICE, dtype))
        norms[0].weight.data = 1 + random((head_dim,), dtype, seed=6, scale=0.2)
        norms[1].weight.data = 1 + random((head_dim,), dtype, seed=7, scale=0.2)
    slots = torch.tensor([5, 90, 17, 0, 33, 60, 61, 2, 95], device=DEVICE)
    kv_cache = torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=DEVICE)

    query = triton_ops.rotate_and_store(
        qkv, *rope, kv_cache, slots, num_heads, num_kv_heads, head_dim,
        None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps),
    )
    with torch.device(DEVICE):
        expected_q, expected_k, expected_v = split_and_rotate(qkv, rope, spec, norms)
    assert_close(query, expected_q)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    assert_close(flat[0][slots], expected_k)
    assert torch.equal(flat[1][slots], expected_v)  # values are copied untouched
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not flat[:, untouched].any()


def test_rotate_and_store_takes_no_tokens():
    kv_cache = torch.zeros((2, 2, 16, 2, 64), device=DEVICE)
    empty = torch.empty((0, 4 * 64 + 2 * 2 * 64), device=DEVICE)
    tables = torch.empty((0, 1, 64), device=DEVICE)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    query = triton_ops.rotate_and_store(empty, tables, tables, kv_cache, slots, 4, 2, 64)
    assert query.shape == (0, 4, 64) and not kv_cache.any()


# the interpreter's tl.dot multiplies bfloat16 operands as their raw bits: bfloat16
# attention is checked on CUDA only (tests/gpu/test_triton_attention.py, many more shapes)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("case", [([1, 1, 1], [5, 16, 31]), ([7, 1, 20], [0, 40, 17])])
def test_paged_attention_kernel_matches_torch_backend(dtype, case):
    """The attention kernel over decodes, fresh prefills and chunks with cached context."""
    from tests.gpu.test_triton_attention import check_against_torch_backend

    check_against_torch_backend(DEVICE, *case, 6, 2, 64, dtype, seed=3)


@pytest.mark.parametrize("window, softcap", [(24, None), (7, 5.0)])
def test_paged_attention_kernel_window_and_softcap(window, softcap):
    from tests.gpu.test_triton_attention import check_window_and_softcap

    check_window_and_softcap(DEVICE, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_splits", [2, 16])
def test_split_kv_decode_matches_torch_backend(dtype, kv_splits):
    """Decodes with their keys split into spans: long contexts, short ones
    (empty spans), and a span ending mid-block."""
    from tests.gpu.test_triton_attention import check_against_torch_backend

    check_against_torch_backend(DEVICE, [1, 1, 1], [5, 300, 64 * 3 + 7], 6, 2, 64, dtype, seed=4, kv_splits=kv_splits)


def test_split_kv_decode_window_and_softcap():
    from tests.gpu.test_triton_attention import check_window_and_softcap

    check_window_and_softcap(DEVICE, 100, 5.0, query_lens=(1, 1, 1), context_lens=(70, 400, 5), kv_splits=4)


def test_kv_splits_fill_one_wave():
    from heron.attention.triton_backend import choose_kv_splits

    assert choose_kv_splits(8, 132, 16) == 16  # Llama-3.2-1B, batch 1, on an H100
    assert choose_kv_splits(64, 132, 16) == 2
    assert choose_kv_splits(128, 132, 16) == 1  # already fills the device
    assert choose_kv_splits(8, 132, 1) == 1  # turned off
    assert choose_kv_splits(8, 132, 4) == 4


def test_split_kv_decode_padded_rows_are_zero_and_harmless():
    """A CUDA graph pads decode batches to a bucket with rows that have no
    sequence (work item -1): they come out 0, and the real rows are unchanged."""
    import dataclasses

    from heron.attention.triton_backend import TritonAttentionBackend, paged_attention
    from tests.gpu.test_triton_attention import make_batch

    layout, cache, generator = make_batch([1, 1, 1], [40, 200, 7], 2, 64, torch.float32, DEVICE, seed=5)
    spec = AttentionLayerSpec(0, 6, 2, 64, 0.125)
    query = torch.randn((3, 6, 64), generator=generator).to(DEVICE)
    backend = TritonAttentionBackend(3, max_kv_splits=4)
    metadata = dataclasses.replace(backend.build_metadata(layout), num_sms=1 << 30)
    expected = torch.empty_like(query)
    paged_attention(expected, query, cache[0], cache[1], metadata, spec)

    def pad(tensor: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([tensor, torch.full_like(tensor[:1], value)])

    padded = dataclasses.replace(
        metadata, work_seq=pad(metadata.work_seq, -1), work_q=pad(metadata.work_q, 0),
        seq_lens=pad(metadata.seq_lens, 0), block_table=pad(metadata.block_table, 0),
        query_start_loc=pad(metadata.query_start_loc, 4),
    )
    padded_query = torch.cat([query, torch.full_like(query[:1], float("nan"))])
    got = torch.full_like(padded_query, float("nan"))
    paged_attention(got, padded_query, cache[0], cache[1], padded, spec)
    assert torch.equal(got[:3], expected)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
