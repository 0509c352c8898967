"""The model runner's own state of each request it holds.

The runner learns about a request from the scheduler's ``NewRequestData`` and
then keeps it up to date from diffs (new blocks, progress) plus the tokens it
samples itself; it forgets the request when the scheduler lists it as finished
or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.core.scheduler_output import NewRequestData
from heron.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the seed space
_SEED_MASK = (1 << 63) - 1


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]  # prompt + output so far (draft tokens excluded)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    # tokens sampled by steps still in flight (async scheduling): on the device,
    # not yet in ``token_ids``
    num_pending_tokens: int = 0
    block_row: int = -1  # its row in the runner's BlockTableRows

    @staticmethod
    def from_new_request(data: NewRequestData, device: torch.device) -> CachedRequestState:
        seed = data.sampling_params.seed
        generator = torch.Generator(device=device) if seed is not None else None
        return CachedRequestState(
            request_id=data.request_id,
            token_ids=list(data.token_ids),
            num_prompt_tokens=data.num_prompt_tokens,
            sampling_params=data.sampling_params,
            eos_token_ids=data.eos_token_ids,
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
            generator=generator,
        )

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, counting those still in flight."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def output_token_ids(self) -> list[int]:
        assert self.num_pending_tokens == 0, "the output is not all on the host yet"
        return self.token_ids[self.num_prompt_tokens :]

    def seeded_generator(self) -> torch.Generator | None:
        """The request's generator, seeded for its next output position: the noise
        for output token k depends only on (seed, k), so a seeded request draws the
        same tokens whatever it is batched with, preempted or not."""
        if self.generator is None:
            return None
        seed = self.sampling_params.seed
        assert seed is not None
        self.generator.manual_seed((seed * _SEED_MIX + self.num_output_tokens) & _SEED_MASK)
        return self.generator
