"""The attention layer every model uses: hands q/k/v to the step's backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from heron.attention.backend import AttentionBackend, AttentionLayerSpec


class Attention(nn.Module):
    """Holds one layer's KV cache (bound by the model runner) and its constants."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """query: [T, H*D]; key, value: [T, Hkv*D]; returns [T, H*D]."""
        assert self.backend is not None and self.kv_cache is not None, "KV cache not bound"
        spec = self.spec
        num_tokens = query.shape[0]
        output = self.backend.forward(
            spec,
            query.view(num_tokens, spec.num_heads, spec.head_dim),
            key.view(num_tokens, spec.num_kv_heads, spec.head_dim),
            value.view(num_tokens, spec.num_kv_heads, spec.head_dim),
            self.kv_cache,
            metadata,
        )
        return output.reshape(num_tokens, spec.num_heads * spec.head_dim)
