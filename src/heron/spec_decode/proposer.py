"""Draft proposers as the model runner sees them: after a step's tokens are
sampled, propose up to ``k`` drafts for each request that sampled; the
scheduler trims them (``max_tokens``, context, budget) and the next step
verifies them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from heron.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from heron.config import EngineConfig
    from heron.worker.input_batch import CachedRequestState


class DraftProposer(Protocol):
    num_speculative_tokens: int

    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """request id -> drafts (omitted when there are none)."""
        ...


class NgramDraftProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self._ngram = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)

    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        drafts = {}
        for state in states:
            proposed = self._ngram.propose(np.asarray(state.token_ids, dtype=np.int64))
            if proposed:
                drafts[state.request_id] = proposed
        return drafts


def build_proposer(config: EngineConfig, device: torch.device) -> DraftProposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramDraftProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    raise NotImplementedError(f"speculative method {spec.method!r} is built by the draft-model runner")
