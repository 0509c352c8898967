"""Per-step sampling inputs for the rows being sampled, as batched tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32; 0 marks a greedy row (empty when all greedy)
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [N] int64; vocab size where disabled
    max_top_k: int | None = None  # the largest top_k (on the host), with top_k
    top_p: torch.Tensor | None = None  # [N] float32; 1.0 where disabled
    min_p: torch.Tensor | None = None  # [N] float32; 0.0 where disabled
    # row -> generator of a request with a seed (others use the engine's generator)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # penalties: None when no row uses them
    presence_penalties: torch.Tensor | None = None  # [N]
    frequency_penalties: torch.Tensor | None = None  # [N]
    repetition_penalties: torch.Tensor | None = None  # [N]
    output_token_ids: list[list[int]] = field(default_factory=list)  # per row
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # per row
    # sparse additions to the logits: (rows, token ids, values)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # tokens forbidden this step (EOS / stop ids before min_tokens, a bad word's last token): (rows, token ids)
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # rows with allowed_token_ids and, per such row, the tokens it may not sample: (rows [R], mask [R, V] bool)
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # most top logprobs any row asked for; None when no row asked for logprobs
    max_num_logprobs: int | None = None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalties is not None
            or self.frequency_penalties is not None
            or self.repetition_penalties is not None
        )
