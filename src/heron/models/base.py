"""The one interface every model heron runs implements, native or not."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from heron.attention.backend import AttentionMetadata
from heron.models.layers.attention import Attention


class CausalLM(nn.Module, ABC):
    """A causal LM over a flat batch: ``forward(input_ids[T], positions[T],
    metadata)`` gives the hidden states ``[T, hidden]`` (``metadata``: the
    attention backend's, built once per step), ``compute_logits`` turns the rows
    to sample into float32 logits, and ``attention_layers`` lists the layers
    whose KV caches the runner binds."""

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def attention_layers(self) -> list[Attention]: ...
