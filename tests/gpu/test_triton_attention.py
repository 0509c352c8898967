"""The Triton paged-attention kernel against the torch backend (itself checked
against transformers) over ragged mixed batches: prefill chunks with and without
cached context, decodes, block boundaries, GQA groups, head sizes, dtypes,
sliding windows and soft-capping; and split-KV decode (keys split into spans
whose outputs a second kernel merges)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heron.attention.backend import AttentionLayerSpec, BatchLayout
from heron.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 16

pytestmark = pytest.mark.gpu


def make_batch(query_lens, context_lens, num_kv_heads, head_dim, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    seq_lens = np.array(context_lens) + np.array(query_lens)
    blocks_per_req = -(-seq_lens // BLOCK_SIZE)
    num_blocks = int(blocks_per_req.sum()) + 8
    # scatter each request's blocks across the pool, in random order
    permutation = torch.randperm(num_blocks, generator=generator).numpy()
    block_table = np.zeros((num_reqs, int(blocks_per_req.max())), dtype=np.int32)
    cursor = 0
    for row, count in enumerate(blocks_per_req):
        block_table[row, :count] = permutation[cursor : cursor + count]
        cursor += count
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    rows = np.repeat(np.arange(num_reqs), query_lens)
    slots = block_table[rows, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    cache = torch.randn((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), generator=generator).to(dtype)
    layout = BatchLayout(
        num_reqs=num_reqs, num_tokens=int(query_start_loc[-1]), query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int64), block_table=block_table,
        slot_mapping=torch.from_numpy(slots).to(device), block_size=BLOCK_SIZE,
    )
    return layout, cache.to(device), generator


CASES = [
    # (query lens, context lens): decodes, fresh prefills, chunks with cached context, mixed
    ([1, 1, 1, 1], [5, 16, 31, 200]),
    ([7, 33, 64, 1], [0, 0, 0, 0]),
    ([16, 17, 5, 100], [16, 15, 100, 3]),
    ([1, 130, 1, 9, 1], [63, 0, 1000, 48, 0]),
]


def triton_metadata(backend, layout, kv_splits: int):
    """The backend's metadata, splitting decode-only batches' keys into exactly
    ``kv_splits`` spans whatever the device's size (1: never split)."""
    metadata = backend.build_metadata(layout)
    if kv_splits > 1:
        assert metadata.max_kv_splits == kv_splits, "split-KV applies to decode-only batches"
        metadata.num_sms = 1 << 30
    return metadata


def check_against_torch_backend(
    device, query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype, seed, kv_splits=1
):
    """The Triton backend's output and cache writes against the torch backend's
    (float32) on one ragged batch."""
    from heron.attention.triton_backend import TritonAttentionBackend

    layout, cache, generator = make_batch(query_lens, context_lens, num_kv_heads, head_dim, dtype, device, seed=seed)
    spec = AttentionLayerSpec(0, num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    tokens = layout.num_tokens
    query = torch.randn((tokens, num_heads, head_dim), generator=generator).to(dtype).to(device)
    key = torch.randn((tokens, num_kv_heads, head_dim), generator=generator).to(dtype).to(device)
    value = torch.randn((tokens, num_kv_heads, head_dim), generator=generator).to(dtype).to(device)
    reference_cache = cache.float()  # a float32 copy, written by the reference path
    triton_backend = TritonAttentionBackend(num_heads // num_kv_heads, max_kv_splits=kv_splits)
    got = triton_backend.forward(spec, query, key, value, cache, triton_metadata(triton_backend, layout, kv_splits))
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(spec, query.float(), key.float(), value.float(), reference_cache,
                                     torch_backend.build_metadata(layout))
    # both stored the step's K/V into the same slots (values representable in dtype)
    assert torch.equal(cache.float(), reference_cache)
    error = (got.float() - expected).norm() / expected.norm()
    tolerance = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert error < tolerance, f"relative error {error:.2e}"
    assert torch.isfinite(got).all()


def check_window_and_softcap(device, window, softcap, query_lens=(1, 40, 9), context_lens=(70, 0, 33), kv_splits=1):
    from heron.attention.triton_backend import TritonAttentionBackend

    layout, cache, generator = make_batch(query_lens, context_lens, 2, 64, torch.float32, device, seed=9)
    spec = AttentionLayerSpec(0, 8, 2, 64, 0.125, sliding_window=window, logits_soft_cap=softcap)
    tokens = layout.num_tokens
    query = torch.randn((tokens, 8, 64), generator=generator).to(device) * 3
    key = torch.randn((tokens, 2, 64), generator=generator).to(device)
    value = torch.randn((tokens, 2, 64), generator=generator).to(device)
    reference_cache = cache.clone()
    triton_backend = TritonAttentionBackend(4, max_kv_splits=kv_splits)
    got = triton_backend.forward(spec, query, key, value, cache, triton_metadata(triton_backend, layout, kv_splits))
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(spec, query, key, value, reference_cache, torch_backend.build_metadata(layout))
    assert ((got - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 64), (9, 3, 64), (32, 8, 128), (16, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_torch_backend(cuda, case, num_heads, num_kv_heads, head_dim, dtype):
    check_against_torch_backend(cuda, *CASES[case], num_heads, num_kv_heads, head_dim, dtype, seed=case)


@pytest.mark.parametrize("window, softcap", [(24, None), (None, 30.0), (7, 5.0)])
def test_sliding_window_and_softcap(cuda, window, softcap):
    check_window_and_softcap(cuda, window, softcap)


# decodes whose keys span many tiles, a few tiles, or less than one (empty spans)
SPLIT_CASES = [([1, 1, 1, 1], [5, 16, 31, 200]), ([1, 1], [1000, 64 * 16 + 3])]


@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
@pytest.mark.parametrize("kv_splits", [2, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(32, 8, 64), (16, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_kv_decode_matches_torch_backend(cuda, case, kv_splits, num_heads, num_kv_heads, head_dim, dtype):
    check_against_torch_backend(cuda, *SPLIT_CASES[case], num_heads, num_kv_heads, head_dim, dtype, seed=case,
                                kv_splits=kv_splits)


@pytest.mark.parametrize("window, softcap", [(24, None), (300, 5.0)])
def test_split_kv_decode_window_and_softcap(cuda, window, softcap):
    check_window_and_softcap(cuda, window, softcap, query_lens=(1, 1, 1), context_lens=(70, 900, 5), kv_splits=4)
