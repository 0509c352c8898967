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
    whose KV caches the runner binds.

    ``output_rows`` (int64 on the CPU, strictly increasing), where given, names the
    only rows of the result the caller reads: a model may leave the others
    unspecified and skip work for them (every row's K/V still goes to the cache)."""

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def attention_layers(self) -> list[Attention]: ...
