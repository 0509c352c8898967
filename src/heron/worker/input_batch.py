"""The model runner's own per-request state, and the sampling metadata built
from it each step.

The runner learns about a request from the scheduler's ``NewRequestData`` and
then keeps it up to date from diffs (new blocks, progress) plus the tokens it
samples itself; it forgets the request when the scheduler lists it as finished
or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from heron.core.scheduler_output import NewRequestData
from heron.sample.metadata import SamplingMetadata
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


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Sampling inputs for one row per state, in order."""
    params = [state.sampling_params for state in states]
    num_greedy = sum(1 for p in params if p.is_greedy)
    all_greedy = num_greedy == len(params)
    # an all-greedy batch needs no temperature tensor (one host-to-device copy less)
    temperature = (
        torch.zeros(0)
        if all_greedy
        else on_device([0.0 if p.is_greedy else p.temperature for p in params], torch.float32, device)
    )
    metadata = SamplingMetadata(temperature=temperature, all_greedy=all_greedy, all_random=num_greedy == 0)
    sampled = [p for p in params if not p.is_greedy]
    if any(p.top_k > 0 for p in sampled):
        # (greedy rows take the argmax: 1 keeps them off the full-vocabulary path)
        top_k = [p.top_k if p.top_k > 0 else 1 if p.is_greedy else vocab_size for p in params]
        metadata.top_k = on_device(top_k, torch.int64, device)
        metadata.max_top_k = max(top_k)
    if any(p.top_p < 1.0 for p in sampled):
        metadata.top_p = on_device([p.top_p for p in params], torch.float32, device)
    if any(p.min_p > 0.0 for p in sampled):
        metadata.min_p = on_device([p.min_p for p in params], torch.float32, device)
    for row, state in enumerate(states):
        generator = state.seeded_generator()
        if generator is not None and not state.sampling_params.is_greedy:
            metadata.generators[row] = generator
    _add_penalties(metadata, states, device)
    _add_logit_bias_and_bans(metadata, states, device)
    requested = [p.logprobs for p in params if p.logprobs is not None]
    metadata.max_num_logprobs = max(requested) if requested else None
    return metadata


def _add_penalties(
    metadata: SamplingMetadata, states: list[CachedRequestState], device: torch.device
) -> None:
    params = [state.sampling_params for state in states]
    if not any(p.has_penalties for p in params):
        return
    metadata.output_token_ids = [state.output_token_ids() for state in states]
    if any(p.presence_penalty != 0.0 for p in params):
        metadata.presence_penalties = on_device([p.presence_penalty for p in params], torch.float32, device)
    if any(p.frequency_penalty != 0.0 for p in params):
        metadata.frequency_penalties = on_device([p.frequency_penalty for p in params], torch.float32, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        metadata.repetition_penalties = on_device([p.repetition_penalty for p in params], torch.float32, device)
        metadata.prompt_token_ids = [state.token_ids[: state.num_prompt_tokens] for state in states]


def _add_logit_bias_and_bans(
    metadata: SamplingMetadata, states: list[CachedRequestState], device: torch.device
) -> None:
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for row, state in enumerate(states):
        params = state.sampling_params
        if params.logit_bias:
            for token_id, value in params.logit_bias.items():
                bias_rows.append(row)
                bias_tokens.append(token_id)
                bias_values.append(value)
        if state.num_output_tokens < params.min_tokens:
            banned = set(params.stop_token_ids or [])
            if not params.ignore_eos:
                banned |= state.eos_token_ids
            ban_rows.extend([row] * len(banned))
            ban_tokens.extend(sorted(banned))
    if bias_rows:
        metadata.logit_bias = (
            on_device(bias_rows, torch.int64, device),
            on_device(bias_tokens, torch.int64, device),
            on_device(bias_values, torch.float32, device),
        )
    if ban_rows:
        metadata.banned_tokens = (
            on_device(ban_rows, torch.int64, device),
            on_device(ban_tokens, torch.int64, device),
        )


@dataclass(frozen=True)
class PendingInputIds:
    """Input ids sampled by the step still in flight, on the device (async
    scheduling): ``token_ids[i]`` goes to flat position ``positions[i]``, or to
    position ``i`` when ``positions`` is None: the common case of a decode batch in
    the same order as the step before, which needs no index copied to the device."""

    token_ids: torch.Tensor
    positions: torch.Tensor | None = None

    def write_into(self, input_ids: torch.Tensor) -> None:
        if self.positions is None:
            input_ids[: self.token_ids.shape[0]].copy_(self.token_ids)
        else:
            input_ids.index_copy_(0, self.positions, self.token_ids)


def on_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list or a numpy array) as a device tensor. The copy does not
    wait for the device: a blocking host-to-device copy waits for all queued
    device work, which would stall async scheduling's overlap."""
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values).to(device=device, dtype=dtype, non_blocking=True)
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
