"""The attention layer every model uses: turns the fused Q/K/V projection into
rotated heads and hands them to the step's backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from heron.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from heron.models.layers.fused import triton_kernels
from heron.models.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from heron.models.layers.norm import RMSNorm


class Attention(nn.Module):
    """Holds one layer's KV cache (bound by the model runner) and its constants."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend[Any] | None = None

    def forward(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> torch.Tensor:
        """qkv: ``[T, (H + 2 Hkv) * D]`` (Q heads, then K heads, then V heads);
        ``rope`` = the step's (cos, signed sin) tables; ``qk_norm`` = per-head
        RMSNorms of Q and K applied before RoPE (Qwen3). Returns ``[T, H * D]``."""
        assert self.backend is not None and self.kv_cache is not None, "KV cache not bound"
        spec = self.spec
        num_tokens = qkv.shape[0]
        fused = self.backend.attends_from_cache and not torch.compiler.is_compiling()
        kernels = triton_kernels() if fused else None
        if kernels is not None:
            # one kernel rotates Q and K and writes K/V into the cache; the backend
            # then reads this step's K/V from the cache like the rest of the context
            query = kernels.rotate_and_store(
                qkv,
                *rope,
                self.kv_cache,
                metadata.slot_mapping,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                # Q and K norms of a layer share the model's rms_norm_eps
                None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps),
            )
            output = self.backend.attend_cached(spec, query, self.kv_cache, metadata)
        else:
            query, key, value = split_and_rotate(qkv, rope, spec, qk_norm)
            output = self.backend.forward(spec, query, key, value, self.kv_cache, metadata)
        return output.reshape(num_tokens, spec.num_heads * spec.head_dim)


def split_and_rotate(
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    spec: AttentionLayerSpec,
    qk_norm: tuple[RMSNorm, RMSNorm] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch ops: ``qkv`` -> query ``[T, H, D]``, key and value ``[T, Hkv, D]``,
    with the Q/K heads normalized (if asked) and rotated."""
    num_tokens = qkv.shape[0]
    num_heads, num_kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q_and_k = qkv[:, : q_size + kv_size].reshape(num_tokens, num_heads + num_kv_heads, head_dim)
    if qk_norm is not None:
        q, k = q_and_k.split([num_heads, num_kv_heads], dim=1)
        q_and_k = torch.cat((qk_norm[0](q), qk_norm[1](k)), dim=1)
    q_and_k = apply_rotary(q_and_k, *rope)  # one pass over Q and K together
    query = q_and_k[:, :num_heads].contiguous()
    key = q_and_k[:, num_heads:].contiguous()
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    return query, key, value
