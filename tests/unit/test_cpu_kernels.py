"""heron's native CPU paged-decode kernel against the torch path."""

from __future__ import annotations

import pytest
import torch

from heron.attention import cpu_kernels
from heron.attention.backend import AttentionLayerSpec
from heron.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

pytestmark = pytest.mark.skipif(cpu_kernels.native_library() is None, reason="no C compiler")


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 8, 32), (16, 2, 128)])
@pytest.mark.parametrize("window", [None, 20])
def test_native_decode_matches_torch(num_heads, num_kv_heads, head_dim, window):
    generator = torch.Generator().manual_seed(num_heads + (window or 0))
    num_blocks, block_size, num_seqs = 64, 16, 7
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    seq_lens = torch.tensor([1, 15, 16, 17, 33, 100, 160], dtype=torch.int64)
    max_blocks = 10
    block_table = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in range(num_seqs)])
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    spec = AttentionLayerSpec(0, num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
    metadata = TorchAttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_tokens=num_seqs, block_size=block_size,
        decode_token_index=torch.arange(num_seqs), decode_block_table=block_table,
        decode_block_ids=block_table.flatten(), decode_seq_lens=seq_lens, all_decode=True,
    )
    expected = TorchAttentionBackend._decode_with_torch(spec, query, cache, metadata)
    got = cpu_kernels.paged_decode_attention(query, cache, block_table, seq_lens, spec.scale, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(960, 576), (64, 1536), (5, 32)])
def test_int4_linear_matches_its_dequantized_weights(shape):
    """The C kernel (up to 16 rows) and the torch path (17) both compute the
    dequantized weights times the int8-rounded input, whatever the batch."""
    from heron.models.quantization import Int4WeightOnlyLinear, round_activations_q8

    torch.manual_seed(0)
    out_features, in_features = shape
    layer = Int4WeightOnlyLinear(torch.randn(out_features, in_features) * 0.05, torch.randn(out_features))
    assert layer._native, "the C kernel must build on this machine"
    for rows in (1, 2, 3, 4, 5, 9, 16, 17):
        x = torch.randn(rows, in_features)
        x[0, :32] = 0.0  # an all-zero block
        x[-1, 5] = 40.0  # an outlier only moves its own block's scale
        expected = round_activations_q8(x) @ layer.dequantized.T + layer.bias
        got = layer(x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        exact = x @ layer.dequantized.T + layer.bias
        assert ((got - exact).norm() / exact.norm()).item() < 0.02  # 8-bit inputs: a small error


def test_int8_rounding_of_activations():
    from heron.models.quantization import _round_activations_q8_torch, round_activations_q8

    x = torch.zeros(2, 64)
    x[0, :16] = torch.linspace(-1.0, 1.0, 16)
    x[0, 16:32] = torch.linspace(-0.01, 0.02, 16)  # its own scale: not flushed by the block beside it
    x[1, 40] = 3.0
    rounded = round_activations_q8(x)
    assert torch.all((rounded[0, :16] - x[0, :16]).abs() <= 0.5 / 127 + 1e-7)
    assert torch.all((rounded[0, 16:32] - x[0, 16:32]).abs() <= 0.5 * 0.02 / 127 + 1e-9)
    assert torch.equal(rounded[0, 32:], x[0, 32:]) and torch.equal(rounded[1], x[1])  # zeros and the max are exact
    big = torch.randn(37, 1536) * torch.rand(1536) * 5
    assert torch.equal(round_activations_q8(big), _round_activations_q8_torch(big))  # C and torch agree bit for bit


def test_int4_reproduces_q4_1_weights():
    """Weights already in GGUF's Q4_1 form (d * q + m, every block using q = 0
    and 15) come back as the same values."""
    from heron.models.quantization import Int4WeightOnlyLinear

    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (8, 4, 32), generator=generator).float()
    q[:, :, 0], q[:, :, 1] = 0, 15
    d = torch.rand(8, 4, 1, generator=generator) * 0.01 + 1e-3
    m = torch.randn(8, 4, 1, generator=generator) * 0.05
    weight = (q * d + m).reshape(8, 128)
    layer = Int4WeightOnlyLinear(weight)
    torch.testing.assert_close(layer.dequantized, weight, rtol=1e-5, atol=1e-6)


def test_int8_head_matches_its_weights_and_rounded_inputs():
    """The int4 mode's LM head: C kernel (up to 16 rows) and torch path agree."""
    from heron.models.quantization import Int8WeightInt8InputLinear, round_activations_q8

    torch.manual_seed(0)
    weight = torch.randn(300, 96)
    weight[7] *= 50  # scales are per output channel
    head = Int8WeightInt8InputLinear(weight)
    assert head._native
    for rows in (1, 3, 4, 16, 17):
        x = torch.randn(rows, 96)
        x[0, 10] = -25.0
        expected = round_activations_q8(x) @ head.dequantized.T
        torch.testing.assert_close(head(x), expected, rtol=1e-4, atol=1e-3)
        exact = x @ weight.T
        assert ((head(x) - exact).norm() / exact.norm()).item() < 0.05  # row 0's outlier coarsens its block
