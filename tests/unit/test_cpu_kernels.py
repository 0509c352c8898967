"""heron's native CPU kernels (paged decode attention, low-bit linears) against torch."""

from __future__ import annotations

import pytest
import torch

from heron.attention.backend import AttentionLayerSpec
from heron.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from heron.kernels.cpu import library as cpu_library
from heron.kernels.cpu import ops as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_library.native_library() is None, reason="no C compiler")


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 8, 32), (16, 2, 128)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("num_seqs", [7, 10])  # tasks per (sequence, KV head) below 8 sequences, per sequence above
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_native_decode_matches_torch(num_heads, num_kv_heads, head_dim, window, num_seqs, cache_dtype):
    generator = torch.Generator().manual_seed(num_heads + (window or 0))
    num_blocks, block_size = 64, 16
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    seq_lens = torch.tensor([1, 15, 16, 17, 33, 100, 160, 2, 48, 159][:num_seqs], dtype=torch.int64)
    max_blocks = 10
    block_table = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in range(num_seqs)])
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    spec = AttentionLayerSpec(0, num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
    metadata = TorchAttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_tokens=num_seqs, block_size=block_size,
        decode_token_index=torch.arange(num_seqs), decode_block_table=block_table,
        decode_block_ids=block_table.flatten(), decode_seq_lens=seq_lens, all_decode=True,
    )
    # (a float16 cache read as float32)
    expected = TorchAttentionBackend._decode_with_torch(spec, query, cache, metadata)
    got = cpu_kernels.paged_decode_attention(query, cache, block_table, seq_lens, spec.scale, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(960, 576), (64, 1536), (5, 32), (20, 64)])
def test_int4_linear_matches_its_dequantized_weights(shape):
    """The C kernel computes the dequantized weights times the int8-rounded
    input, at every batch size (row tiles of 4 and their remainders, panels of
    64 rows), and a row's result does not depend on the rows beside it. Output
    counts that are not a multiple of 8 are padded and cut."""
    from heron.models.quantization import Int4WeightOnlyLinear, round_activations_q8

    torch.manual_seed(0)
    out_features, in_features = shape
    layer = Int4WeightOnlyLinear(torch.randn(out_features, in_features) * 0.05, torch.randn(out_features))
    assert layer._native, "the C kernel must build on this machine"
    single = torch.randn(1, in_features, generator=torch.Generator().manual_seed(1))
    alone = layer(single)
    for rows in (1, 2, 3, 4, 5, 9, 16, 17, 70):
        x = torch.randn(rows, in_features)
        x[0, :32] = 0.0  # an all-zero block
        x[-1, 5] = 40.0  # an outlier only moves its own block's scale
        expected = round_activations_q8(x) @ layer.dequantized.T + layer.bias
        got = layer(x)
        assert got.shape == (rows, out_features)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        exact = x @ layer.dequantized.T + layer.bias
        assert ((got - exact).norm() / exact.norm()).item() < 0.02  # 8-bit inputs: a small error
        x[rows // 2] = single[0]
        assert torch.equal(layer(x)[rows // 2], alone[0])  # batch-invariant, bit for bit


def test_int4_column_tiles_round_trip():
    """The column-tile layout holds each 4-bit value where the kernel reads it."""
    from heron.models.quantization import _from_column_tiles, _to_column_tiles

    generator = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (16, 3, 32), generator=generator, dtype=torch.uint8)
    scale, low = torch.rand(16, 3, generator=generator), torch.randn(16, 3, generator=generator)
    tiles, scales, mins = _to_column_tiles(q, scale, low)
    assert tiles.shape == (2, 3, 128) and scales.shape == (2, 3, 8)
    # tile 1, block 2, column 5, input 16 h + 4 (2 nibble + j) + i = 16 + 4 * 3 + 1 (h = 1, nibble = 1, j = 1, i = 1)
    assert tiles[1, 2, 64 + 32 + 4 * 5 + 1] >> 4 == q[8 + 5, 2, 29]
    assert scales[1, 2, 5] == scale[13, 2] and mins[1, 2, 5] == low[13, 2]
    back = _from_column_tiles(tiles, scales, mins)
    assert torch.equal(back[0], q) and torch.equal(back[1], scale) and torch.equal(back[2], low)


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
    tiny = torch.zeros(1, 32)
    tiny[0, 3] = 1e-38  # 127 / 1e-38 overflows float32: such a block rounds to zeros, in C and torch alike
    tiny[0, 20] = 0.5
    for rounded in (round_activations_q8(tiny), _round_activations_q8_torch(tiny)):
        assert torch.equal(rounded[0, :16], torch.zeros(16)) and rounded[0, 20] == 0.5
    for seed in range(20):  # some hold ties (x * 127 / amax = 19.5) that 127 * (1 / amax) would misround
        generator = torch.Generator().manual_seed(seed)
        big = torch.randn(37, 1536, generator=generator) * torch.rand(1536, generator=generator) * 5
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
    """The int4 mode's LM head: the C kernel computes its int8 weights times the
    rounded inputs at every batch size, a row's result independent of its batch;
    output counts not a multiple of 8 are padded and cut."""
    from heron.models.quantization import Int8WeightInt8InputLinear, round_activations_q8

    torch.manual_seed(0)
    weight = torch.randn(300, 96)
    weight[7] *= 50  # scales are per output channel
    head = Int8WeightInt8InputLinear(weight)
    assert head._native
    single = torch.randn(1, 96, generator=torch.Generator().manual_seed(1))
    alone = head(single)
    for rows in (1, 3, 4, 16, 17, 70):
        x = torch.randn(rows, 96)
        x[0, 10] = -25.0
        expected = round_activations_q8(x) @ head.dequantized.T
        torch.testing.assert_close(head(x), expected, rtol=1e-4, atol=1e-3)
        exact = x @ weight.T
        assert ((head(x) - exact).norm() / exact.norm()).item() < 0.05  # row 0's outlier coarsens its block
        x[rows // 2] = single[0]
        assert torch.equal(head(x)[rows // 2], alone[0])  # batch-invariant, bit for bit
    # the tiles hold the weights where the kernel reads them: dequantized is the weight to int8 precision
    assert ((head.dequantized - weight).abs() <= weight.abs().amax(dim=1, keepdim=True) / 254 + 1e-6).all()


def test_kernel_sources_ship_in_the_package():
    """Every C source and header the kernel build reads is package data (a wheel
    without a header would fail to compile and silently fall back to torch)."""
    import fnmatch
    import pathlib
    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["heron.kernels.cpu"]
    for name in cpu_library.SOURCES + cpu_library.HEADERS:
        assert any(fnmatch.fnmatch(f"csrc/{name}", pattern) for pattern in patterns), name


def test_the_kernel_cache_keeps_the_newest_builds(tmp_path):
    """Each kernel edit, upgrade or instruction set added a build directory (about
    220 KB) for ever; the cache keeps the most recently built or used."""
    import os

    for age in range(5):
        build = tmp_path / f"build{age}"
        build.mkdir()
        (build / "libheron_cpu.so").write_bytes(b"x")
        os.utime(build, (1000 - age, 1000 - age))  # build0 the newest
    (tmp_path / "stray-file").write_text("not a build")
    cpu_library._prune(str(tmp_path), keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build0", "build1", "build2", "stray-file"]


@pytest.mark.parametrize("shape", [(40, 64), (13, 96), (1, 32)])
def test_int4_packing_in_c_equals_the_torch_formula(shape):
    """Load-time packing (csrc/quantize_weights.c) gives the torch path's tiles,
    scales and minimums bit for bit, padding rows included; constant blocks too."""
    from heron.models.quantization import quantize_q4_tiles_torch

    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 0.1
    weight[0, :32] = 0.25  # a constant block: d = 1, m = its value
    weight[-1, -32:] = torch.linspace(-1, 1, 32)  # exact ties after scaling
    packed = cpu_kernels.pack_q4_tiles(weight)
    for got, expected in zip(packed, quantize_q4_tiles_torch(weight)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("shape", [(40, 64), (13, 96), (1, 32), (9, 4)])
def test_int8_packing_in_c_equals_the_torch_formula(shape):
    """The int8 layers' (and the LM head's) packing in C gives the torch
    formula's tiles and scales bit for bit: padding rows, an all-zero row (the
    1e-8 floor), a row's largest magnitude negative and ties after scaling."""
    from heron.models.quantization import quantize_q8_tiles_torch

    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1])) * 0.1
    weight[0] = 0.0
    if shape[0] > 2:
        weight[1, 0] = -3.0
        weight[2] = torch.linspace(-1, 1, shape[1])
    packed = cpu_kernels.pack_q8_tiles(weight)
    for got, expected in zip(packed, quantize_q8_tiles_torch(weight)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_holds_gguf_4bit_blocks_exactly(qtype):
    """Weights dequantized from Q4_0 or Q4_1 blocks come back bit for bit: each
    block goes on the grid of the rule that made it (in C and in torch alike)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from heron.models.quantization import _from_column_tiles, quantize_q4_tiles_torch

    kind = GGMLQuantizationType[qtype]
    source = torch.randn(24, 256, generator=torch.Generator().manual_seed(2)).numpy()
    weight = torch.from_numpy(dequantize(quantize(source, kind), kind).reshape(24, 256).copy())
    for packed in (cpu_kernels.pack_q4_tiles(weight), quantize_q4_tiles_torch(weight)):
        q, scale, low = _from_column_tiles(*packed)
        assert torch.equal((q.float() * scale[..., None] + low[..., None]).reshape(24, 256), weight)


def test_keys_of_another_shape_than_the_cache_are_refused():
    """A config whose num_key_value_heads disagreed with the model's real heads
    (a GPT-2 config given the key) had its keys viewed into the cache by their
    own shape: prefill matched transformers, decode read scrambled K/V."""
    from heron.attention.backend import AttentionBackend

    cache = torch.zeros(AttentionBackend.kv_cache_shape(4, 8, 2, 16))
    slots = torch.tensor([0, 1])
    AttentionBackend.store_kv(cache, torch.ones(2, 2, 16), torch.ones(2, 2, 16), slots)
    with pytest.raises(ValueError, match=r"keys of \(4, 16\) .* KV cache of \(2, 16\)"):
        AttentionBackend.store_kv(cache, torch.ones(2, 4, 16), torch.ones(2, 4, 16), slots)
