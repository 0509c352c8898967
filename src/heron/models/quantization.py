"""Weight quantization for the CPU: ``int8`` and ``int4``, both with int8 inputs.

Every linear layer's input is rounded to int8 in blocks of 16 (one scale each,
``round_activations_q8``) and multiplied with integer dot products in heron's
register-tiled C kernels (``kernels/cpu/csrc/tiled_linear.c``), at every batch size,
so a row's result does not depend on its batch. (Without a C compiler the float32
GEMM on the dequantized weights computes the same function, up to float32
rounding that does depend on the batch.)

* ``int8``: every linear layer and the LM head keep int8 weights with one float
  scale per output channel (``Int8WeightInt8InputLinear``). On the embedded
  model (``heron bench quality --quantization int8``, BENCHMARKS.md): perplexity
  33.14 vs 32.85 in float32, top-1 agreement 95.6% (the embedded weights are
  Q4_1 at heart, which per-channel int8 cannot hold exactly; ``int4`` can).
* ``int4``: linear layers in GGUF's Q4_1 scheme (``Int4WeightOnlyLinear``), the
  LM head in int8 as above: perplexity 32.80, top-1 agreement 96.5%.

In both modes decode-only steps of a Llama-family model run natively
(``native_decode``: one C call per step).

Layers whose input size is not a multiple of 32 fall back to
``Int8WeightOnlyLinear`` (bfloat16 inputs, a float32 GEMM on int8 weights).
fbgemm's dynamic int8 (7-bit per-tensor activations on AVX2) was 2x faster than
float32 but tripled perplexity, so it is not offered.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import torch
from torch import nn

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)

QUANTIZATION_METHODS = ("none", "int8", "int4")
INT4_BLOCK = 32
TILE_COLUMNS = 8  # output columns per tile of the 4-bit kernel's weight layout
INT4_ACTIVATION_BLOCK = 16  # inputs sharing one int8 scale
MIN_BLOCK_MAX = 1e-30  # input blocks with a smaller largest magnitude round to zeros (csrc/lowbit_input.c)


class Int8WeightOnlyLinear(nn.Module):
    dequantized: torch.Tensor

    """y = bf16(bf16(x) @ (q * scale)^T) + b, q int8 per output channel: the
    fallback for layers whose input size is not a multiple of 32, as a float32
    GEMM on the int8 weights (exactly q * scale). torch's int8 weight-only
    kernel (``_weight_int8pack_mm``) is not used: with an input size of 4 past
    a multiple of 8 it read out of bounds (NaN and 1e30 outputs, then a
    segfault at a few rows; torch 2.13 on AVX2)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        qweight = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.register_buffer(
            "dequantized", qweight.float() * scales.to(torch.bfloat16).float()[:, None], persistent=False
        )
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        out = torch.nn.functional.linear(rows.float(), self.dequantized).to(torch.bfloat16).float()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


def round_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, k] rounded as the 4-bit kernel rounds it: symmetric int8 in
    blocks of 16 along k (scale max|x| / 127, round half to even), back in float32."""
    from heron.kernels.cpu.library import native_library
    from heron.kernels.cpu.ops import round_q8

    if x.dtype == torch.float32 and x.device.type == "cpu" and native_library() is not None:
        return round_q8(x)
    return _round_activations_q8_torch(x)


def _round_activations_q8_torch(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(x.shape[0], x.shape[1] // INT4_ACTIVATION_BLOCK, INT4_ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    # a true division, as C's 127.0f / amax (``127.0 / amax`` is 127 * (1 / amax) in
    # torch, an ulp off now and then, which moves a tie such as 19.5 across a rounding step)
    # blocks under MIN_BLOCK_MAX round to zeros (127 / amax would overflow), as in C
    inverse = torch.where(amax >= MIN_BLOCK_MAX, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127.0)).reshape(x.shape)


class _Int8InputLinear(nn.Module):
    """y = Q8(x) @ dequantized^T + b for a subclass's low-bit weights: the
    subclass's C kernel (``_kernel``) at every batch size, or without the native
    library the float32 GEMM on ``dequantized`` times the same rounded inputs."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None
    _native: bool
    _dequantized: torch.Tensor | None
    PACKED: tuple[str, ...] = ()  # the tensors that hold a subclass's weights (models/packed_cache.py)

    @classmethod
    def from_packed(cls, packed: dict[str, torch.Tensor], in_features: int, out_features: int,
                    bias: torch.Tensor | None) -> _Int8InputLinear:
        """The layer whose ``PACKED`` tensors are ``packed`` (as a layer built from
        float weights holds them), without its float weights: what a cached
        low-bit model is loaded from."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        for name in cls.PACKED:
            setattr(layer, name, packed[name])
        layer.in_features, layer.out_features, layer.bias = in_features, out_features, bias
        layer._use_native_kernel()
        return layer

    def _use_native_kernel(self) -> None:
        """Call at the end of ``__init__``: picks the kernel, or keeps the
        dequantized weights the torch path needs without it."""
        from heron.kernels.cpu.library import native_library

        self._native = native_library() is not None
        self._dequantized = None if self._native else self._dequantize()

    @property
    def uses_native_kernel(self) -> bool:
        """Whether this layer runs heron's C kernel (else the torch fallback)."""
        return self._native

    @property
    def dequantized(self) -> torch.Tensor:
        """The weights as float32 ``[out, in]`` (kept only where the torch path needs them)."""
        return self._dequantized if self._dequantized is not None else self._dequantize()

    def _dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """The C kernel's output, ``[rows, n]`` with ``n`` padded to a multiple of 8."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        if self._native:
            out = self._kernel(rows.contiguous())
            if out.shape[1] != self.out_features:  # padding columns
                out = out[:, : self.out_features].contiguous()
            if self.bias is not None:
                out = out + self.bias
        else:
            out = torch.nn.functional.linear(round_activations_q8(rows), self.dequantized, self.bias)
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)


class Int4WeightOnlyLinear(_Int8InputLinear):
    """y = Q8(x) @ (d * q + m)^T + b: 4-bit weights in blocks of 32 inputs, each
    with a float scale ``d`` and minimum ``m`` (GGUF's Q4_1 scheme, so a Q4_1
    file's weights are reproduced exactly up to float rounding), times the input
    rounded to int8 in blocks of 16 (``round_activations_q8``; llama.cpp's Q4_1 x
    Q8_1 dot products round in blocks of 32, which costs more perplexity here).

    Every batch runs heron's C kernel (csrc/tiled_linear.c: integer dot
    products on the packed nibbles, an eighth of float32's weight bytes), so a
    row's result does not depend on its batch. The weights are kept in that
    kernel's column-tile layout: ``tiles`` [n / 8, k / 32, 128] uint8, ``scales``
    and ``mins`` [n / 8, k / 32, 8] float32, with ``n`` padded to a multiple of 8.
    Without the native library the float32 GEMM on the dequantized weights and
    the same rounded inputs computes the same function."""

    PACKED = ("tiles", "scales", "mins")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        from heron.kernels.cpu.library import native_library

        weight = weight.detach().float()
        out_features, in_features = weight.shape
        if native_library() is not None:  # the same values, about 10x faster
            from heron.kernels.cpu.ops import pack_q4_tiles

            self.tiles, self.scales, self.mins = pack_q4_tiles(weight)
        else:
            self.tiles, self.scales, self.mins = quantize_q4_tiles_torch(weight)
        self.bias = None if bias is None else bias.detach().float()
        self.in_features = in_features
        self.out_features = out_features
        self._use_native_kernel()

    def _dequantize(self) -> torch.Tensor:
        q, scale, low = _from_column_tiles(self.tiles, self.scales, self.mins)
        weight = q.float() * scale[..., None] + low[..., None]
        return weight.reshape(-1, self.in_features)[: self.out_features].contiguous()

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        from heron.kernels.cpu.ops import q4_linear

        return q4_linear(rows, self.tiles, self.scales, self.mins)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weight-only (blocks of 32)"


def quantize_q4_tiles_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [n, k] in 4-bit blocks of 32, in the column tiles; rows padded to a
    multiple of 8 (q = 0, d = 1, m = 0). Each block takes the better (smaller largest
    error) of two grids d * q + m, the rules GGUF's types quantize with, so blocks of
    either type come back exactly: Q4_1's range (m = min, d = (max - min) / 15,
    q = round((w - m) / d)) and Q4_0's symmetric grid (d = -x / 8 for x the first
    weight of largest magnitude, m = -8 d, q = round(w / d + 8)).
    csrc/quantize_weights.c computes the same values."""
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features, in_features // INT4_BLOCK, INT4_BLOCK)
    low = blocks.amin(dim=2)
    scale = (blocks.amax(dim=2) - low) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q, error = _fit_grid(blocks, low, scale, 0.0, low)
    # the symmetric grid, where the range is inexact
    extreme = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    symmetric_scale = extreme / -8.0
    usable = symmetric_scale != 0
    safe_scale = torch.where(usable, symmetric_scale, torch.ones_like(symmetric_scale))
    symmetric_low = safe_scale * -8.0
    symmetric_q, symmetric_error = _fit_grid(blocks, torch.zeros_like(low), safe_scale, 8.0, symmetric_low)
    better = usable & (error > 0) & (symmetric_error < error)
    q = torch.where(better[..., None], symmetric_q, q).to(torch.uint8)
    scale = torch.where(better, safe_scale, scale)
    low = torch.where(better, symmetric_low, low)
    padding = -out_features % TILE_COLUMNS  # zero columns: q = 0, m = 0
    if padding:
        q = torch.cat([q, q.new_zeros(padding, *q.shape[1:])])
        scale = torch.cat([scale, scale.new_ones(padding, scale.shape[1])])
        low = torch.cat([low, low.new_zeros(padding, low.shape[1])])
    return _to_column_tiles(q, scale, low)


def _fit_grid(
    blocks: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, offset: float, low: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q = clamp(round((w - shift) / d + offset), 0, 15) per block, and the block's
    largest error |q d + m - w|, each step rounded as csrc/quantize_weights.c rounds it."""
    q = ((blocks - shift[..., None]) / scale[..., None] + offset).round().clamp(0, 15)
    error = (((q * scale[..., None]) + low[..., None]) - blocks).abs().amax(dim=2)
    return q, error


# A block's input 16 h + 4 (2 * nibble + j) + i of column c sits in the nibble of byte
# 64 h + 32 j + 4 c + i: from (tile, column, block, half, nibble, vector, input) order
# to (tile, block, half, vector, column, input, nibble)
_TILE_ORDER = (0, 2, 3, 5, 1, 6, 4)


def _to_column_tiles(
    q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit values ``q`` [n, k / 32, 32] and their block scales and minimums [n, k / 32]
    (n a multiple of 8) in csrc/tiled_linear.c's column-tile layout."""
    n, nb, _ = q.shape
    grouped = q.reshape(n // TILE_COLUMNS, TILE_COLUMNS, nb, 2, 2, 2, 4).permute(_TILE_ORDER)
    tiles = (grouped[..., 0] | (grouped[..., 1] << 4)).reshape(n // TILE_COLUMNS, nb, 128).contiguous()

    def per_tile(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(n // TILE_COLUMNS, TILE_COLUMNS, nb).transpose(1, 2).contiguous()

    return tiles, per_tile(scale), per_tile(low)


def _from_column_tiles(
    tiles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``_to_column_tiles``."""
    num_tiles, nb, _ = tiles.shape
    grouped = torch.stack([tiles & 0x0F, tiles >> 4], dim=-1)
    grouped = grouped.reshape(
        num_tiles, nb, 2, 2, TILE_COLUMNS, 4, 2
    )  # tile, block, half, vector, column, input, nibble
    inverse = [_TILE_ORDER.index(axis) for axis in range(len(_TILE_ORDER))]
    q = grouped.permute(inverse).reshape(num_tiles * TILE_COLUMNS, nb, 32)

    def per_column(values: torch.Tensor) -> torch.Tensor:
        return values.transpose(1, 2).reshape(num_tiles * TILE_COLUMNS, nb)

    return q, per_column(scales), per_column(mins)


def quantize_q8_tiles_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [n, k] in int8 per output row (scale = max |w| / 127, at least
    1e-8 / 127; q = round(w / scale)), in the column tiles: tiles [n / 8, k / 4, 8, 4]
    int8 (8 columns x 4 inputs a vector), scales [n] float32, rows padded to a
    multiple of 8 (q = 0, scale = 1). The reference for csrc/quantize_weights.c's
    heron_pack_q8_tiles and the fallback without a C compiler."""
    n, k = weight.shape
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    qweight = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    padding = -n % TILE_COLUMNS
    if padding:
        qweight = torch.cat([qweight, qweight.new_zeros(padding, k)])
        scales = torch.cat([scales, scales.new_ones(padding)])
    tiles = qweight.reshape(-1, TILE_COLUMNS, k // 4, 4).transpose(1, 2).contiguous()
    return tiles, scales.contiguous()


class Int8WeightInt8InputLinear(_Int8InputLinear):
    """The int8 mode's layers and both modes' LM head: y = Q8(x) @ (q * scale)^T
    + b, int8 weights with one float scale per output channel, times the input
    rounded as the 4-bit layers round theirs, in heron's register-tiled C kernel at every batch size
    (integer dot products, a quarter of float32's bytes). The weights are kept in
    the kernel's column tiles: ``tiles`` [n / 8, k / 4, 8, 4] int8 (8 columns x 4
    inputs a vector), ``scales`` [n] float32, with ``n`` padded to a multiple of 8."""

    PACKED = ("tiles", "scales")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        from heron.kernels.cpu.library import native_library

        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        if self.in_features % INT4_BLOCK != 0:
            raise ValueError(f"int8 inputs need a multiple of {INT4_BLOCK} input features, got {self.in_features}")
        if native_library() is not None:  # the same values in one C pass (0.3 s less per start for a 49k-row head)
            from heron.kernels.cpu.ops import pack_q8_tiles

            self.tiles, self.scales = pack_q8_tiles(weight)
        else:
            self.tiles, self.scales = quantize_q8_tiles_torch(weight)
        self.bias = None if bias is None else bias.detach().float()
        self._use_native_kernel()

    def _dequantize(self) -> torch.Tensor:
        qweight = self.tiles.transpose(1, 2).reshape(-1, self.in_features)
        return (qweight.float() * self.scales[:, None])[: self.out_features].contiguous()

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        from heron.kernels.cpu.ops import q8_linear

        return q8_linear(rows, self.tiles, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and inputs"


def quantize_model(model: M, method: str, device: torch.device) -> M:
    """Replace the model's linear layers (and its LM head) with quantized ones,
    all with int8 inputs: ``int8`` weights per output channel everywhere;
    ``int4``: linear layers in 4-bit blocks, the LM head (often tied to the
    embedding, and the most sensitive) in int8."""
    if method in (None, "none"):
        return model
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {QUANTIZATION_METHODS}")
    if device.type != "cpu":
        raise ValueError(f"{method} quantization runs on the CPU; on CUDA use bfloat16")
    # the head first, whether tied or not (an untied one took int4 in the loop below under int4)
    set_head = getattr(model, "quantize_lm_head", None)
    if callable(set_head):
        set_head(_int8_head)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if child.in_features % INT4_BLOCK != 0:
                    setattr(parent, name, Int8WeightOnlyLinear(child.weight, child.bias))
                elif method == "int4":
                    setattr(parent, name, Int4WeightOnlyLinear(child.weight, child.bias))
                else:
                    setattr(parent, name, Int8WeightInt8InputLinear(child.weight, child.bias))
                count += 1
    logger.info("quantized %d linear layers to %s (the LM head to int8), int8 inputs", count, method)
    return model


def _int8_head(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The LM head in int8 (the most sensitive layer): with int8 inputs where its input size allows."""
    if weight.shape[1] % INT4_BLOCK == 0:
        return Int8WeightInt8InputLinear(weight, bias)
    return Int8WeightOnlyLinear(weight, bias)


def low_bit_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers with int8 inputs (int4 and int8 weights)."""
    return [module for module in model.modules() if isinstance(module, _Int8InputLinear)]
