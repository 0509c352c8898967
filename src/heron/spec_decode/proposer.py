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
    from heron.worker.request_state import CachedRequestState


class DraftProposer(Protocol):
    num_speculative_tokens: int

    def propose(self, states: list[CachedRequestState], sampled: list[bool]) -> dict[str, list[int]]:
        """Given every request scheduled this step (``sampled[i]``: whether
        ``states[i]`` got a new token), request id -> drafts for the next step
        (omitted when there are none)."""
        ...

    def add_request(self, request_id: str, num_computed_tokens: int) -> None: ...

    def remove_request(self, request_id: str) -> None: ...

    def kv_cache_bytes_per_block(self) -> int:
        """KV bytes the proposer keeps per block (a draft model's own caches)."""
        ...

    def bind_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """Allocate the proposer's own KV caches (on the pool's block ids); returns them."""
        ...


class NgramDraftProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self._ngram = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)

    def propose(self, states: list[CachedRequestState], sampled: list[bool]) -> dict[str, list[int]]:
        drafts = {}
        for state, did_sample in zip(states, sampled):
            if not did_sample:
                continue
            proposed = self._ngram.propose(np.asarray(state.token_ids, dtype=np.int64))
            if proposed:
                drafts[state.request_id] = proposed
        return drafts

    def add_request(self, request_id: str, num_computed_tokens: int) -> None:
        pass  # stateless: it reads the request's tokens

    def remove_request(self, request_id: str) -> None:
        pass

    def kv_cache_bytes_per_block(self) -> int:
        return 0  # no model, no cache

    def bind_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        return []  # n-gram drafts need no KV cache


def build_proposer(config: EngineConfig, device: torch.device) -> DraftProposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramDraftProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from heron.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, device)
