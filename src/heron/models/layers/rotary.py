"""Rotary position embeddings, computed the way Hugging Face computes them (so fp32
outputs match): inverse frequencies in float32, angles = position * inv_freq,
applied to the two halves of each head ("rotate half", NeoX style).

RoPE types: "default", "linear" (positions divided by a factor), "llama3"
(frequency-dependent scaling of Llama 3.1+) and "yarn" (Qwen's long-context
setting: frequencies blended between interpolated and extrapolated along a
ramp, and cos/sin scaled by an attention factor). Explicit per-frequency
factors, as llama.cpp stores them in GGUF files, divide the inverse
frequencies. Other types ("dynamic", "longrope") run through transformers
(``models/implementation.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from heron.loader.arch_config import NATIVE_ROPE_TYPES


def compute_inv_freq(rotary_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    base = float(rope["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low_freq_factor = float(rope["low_freq_factor"])
        high_freq_factor = float(rope["high_freq_factor"])
        old_context_len = float(rope["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, rope, base)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported natively (supported: {', '.join(NATIVE_ROPE_TYPES)})"
    )


def _yarn_inv_freq(rotary_dim: int, rope: dict[str, Any], base: float) -> torch.Tensor:
    """Frequencies whose wavelength fits the original context many times keep
    their value (extrapolated), those that fit it less than once are divided by
    the factor (interpolated), and a linear ramp over dimensions blends between
    (the correction range from ``beta_fast`` / ``beta_slow`` rotations)."""
    factor = float(rope["factor"])
    original = float(rope["original_max_position_embeddings"])
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def dimension_of(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight


def attention_factor(rope: dict[str, Any]) -> float:
    """What cos and sin are multiplied by: 1, except for YaRN (its
    ``attention_factor``, else ``0.1 ln(factor) + 1``, or the ratio of two such
    terms with ``mscale`` / ``mscale_all_dim``)."""
    if rope.get("rope_type") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = float(rope["factor"])

    def scale(mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return scale(float(mscale)) / scale(float(mscale_all_dim))
    return scale()


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key for arbitrary per-token positions (flat batch)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope: dict[str, Any],
        freq_factors: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope = dict(rope)
        self.freq_factors = freq_factors
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the float32 cos/sin tables (after a dtype change, they must
        stay float32)."""
        inv_freq = compute_inv_freq(self.head_dim, self.rope)
        if self.freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(self.freq_factors, dtype=torch.float32)
        device = self.cos_cache.device if hasattr(self, "cos_cache") else None
        positions = torch.arange(self.max_position, dtype=torch.float32)
        angles = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        emb = torch.cat((angles, angles), dim=-1)
        scaling = attention_factor(self.rope)
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(device), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for the step's positions, ``[T, 1, D]``; computed once
        per step and shared by every layer."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos, signed_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with rotate_half(x) = (-x2, x1): the
    sign lives in ``signed_sin`` and the half swap is a roll. x: [T, heads, D]."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)
