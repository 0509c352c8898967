"""The sampler's batched inputs (``SamplingMetadata``), built each step from the
rows' requests: the parameters' tensors are kept while a decode batch's rows stay
the same, and only per-step state (output tokens, seeded generators, bans) is
built anew."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.sample.metadata import SamplingMetadata
from heron.sampling_params import SamplingParams
from heron.token_bans import banned_next_tokens
from heron.worker.request_state import CachedRequestState
from heron.worker.step_inputs import on_device


@dataclass(frozen=True)
class _ParamsPart:
    """What a batch's sampling metadata takes from its rows' parameters alone (no
    per-step state): the same for the same parameter objects in the same order."""

    params: tuple[SamplingParams, ...]  # held, so that their ids stay theirs
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    max_top_k: int | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    max_num_logprobs: int | None
    seeded_rows: tuple[int, ...]  # sampled rows with a seed: a generator each step
    min_tokens_rows: tuple[int, ...]  # rows that may need EOS / stop ids banned
    bad_words_rows: tuple[int, ...]  # rows whose bad words may need a token banned
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (rows, forbidden mask) of rows with allowed_token_ids

    @staticmethod
    def of(params: tuple[SamplingParams, ...], vocab_size: int, device: torch.device) -> _ParamsPart:
        greedy = [p.is_greedy for p in params]
        num_greedy = sum(greedy)
        all_greedy = num_greedy == len(params)
        # an all-greedy batch needs no temperature tensor (one host-to-device copy less)
        temperature = (
            torch.zeros(0)
            if all_greedy
            else on_device([0.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, device)
        )
        sampled = [p for p, g in zip(params, greedy) if not g]
        top_k = max_top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in sampled):
            # (greedy rows take the argmax: 1 keeps them off the full-vocabulary path)
            values = [p.top_k if p.top_k > 0 else 1 if g else vocab_size for p, g in zip(params, greedy)]
            top_k, max_top_k = on_device(values, torch.int64, device), max(values)
        if any(p.top_p < 1.0 for p in sampled):
            top_p = on_device([p.top_p for p in params], torch.float32, device)
        if any(p.min_p > 0.0 for p in sampled):
            min_p = on_device([p.min_p for p in params], torch.float32, device)
        presence = frequency = repetition = None
        if any(p.presence_penalty != 0.0 for p in params):
            presence = on_device([p.presence_penalty for p in params], torch.float32, device)
        if any(p.frequency_penalty != 0.0 for p in params):
            frequency = on_device([p.frequency_penalty for p in params], torch.float32, device)
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = on_device([p.repetition_penalty for p in params], torch.float32, device)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return _ParamsPart(
            params=params, temperature=temperature, all_greedy=all_greedy, all_random=num_greedy == 0,
            top_k=top_k, max_top_k=max_top_k, top_p=top_p, min_p=min_p,
            logit_bias=_logit_bias(params, device),
            presence_penalties=presence, frequency_penalties=frequency, repetition_penalties=repetition,
            max_num_logprobs=max(requested) if requested else None,
            seeded_rows=tuple(row for row, (p, g) in enumerate(zip(params, greedy)) if p.seed is not None and not g),
            min_tokens_rows=tuple(row for row, p in enumerate(params) if p.min_tokens > 0),
            bad_words_rows=tuple(row for row, p in enumerate(params) if p.bad_words_token_ids),
            allowed_tokens=_allowed_tokens(params, vocab_size, device),
        )

    def metadata(self, states: list[CachedRequestState], device: torch.device) -> SamplingMetadata:
        """This step's metadata: the parameters' part plus what changes per step
        (seeded generators at the next position, min_tokens bans, the tokens that
        penalties count)."""
        metadata = SamplingMetadata(
            temperature=self.temperature, all_greedy=self.all_greedy, all_random=self.all_random,
            top_k=self.top_k, max_top_k=self.max_top_k, top_p=self.top_p, min_p=self.min_p,
            logit_bias=self.logit_bias, presence_penalties=self.presence_penalties,
            frequency_penalties=self.frequency_penalties, repetition_penalties=self.repetition_penalties,
            max_num_logprobs=self.max_num_logprobs, allowed_tokens=self.allowed_tokens,
        )
        for row in self.seeded_rows:
            generator = states[row].seeded_generator()
            if generator is not None:
                metadata.generators[row] = generator
        if metadata.has_penalties:  # the tokens they count, as of this step
            metadata.output_token_ids = [state.output_token_ids() for state in states]
            if metadata.repetition_penalties is not None:
                metadata.prompt_token_ids = [state.token_ids[: state.num_prompt_tokens] for state in states]
        if self.min_tokens_rows or self.bad_words_rows:
            _add_bans(metadata, states, self.min_tokens_rows, self.bad_words_rows, device)
        return metadata


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Sampling inputs for one row per state, in order."""
    params = tuple(state.sampling_params for state in states)
    return _ParamsPart.of(params, vocab_size, device).metadata(states, device)


class SamplingMetadataBuilder:
    """``build_sampling_metadata`` that keeps the parameters' part (device tensors
    of temperatures, top-k/p, min-p, logit bias...) while a step's rows are the same
    parameter objects in the same order as the step before: a decode batch in
    steady state then builds only what changes per step. The part holds its
    parameter objects, so an id in the key cannot be a new object's."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._key: tuple[int, ...] | None = None
        self._part: _ParamsPart | None = None

    def build(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = tuple([state.sampling_params for state in states])
        key = tuple(map(id, params))
        if key != self._key or self._part is None:
            self._part = _ParamsPart.of(params, self.vocab_size, self.device)
            self._key = key
        return self._part.metadata(states, self.device)


def _logit_bias(
    params: tuple[SamplingParams, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            for token_id, value in p.logit_bias.items():
                rows.append(row)
                tokens.append(token_id)
                values.append(value)
    if not rows:
        return None
    return (
        on_device(rows, torch.int64, device),
        on_device(tokens, torch.int64, device),
        on_device(values, torch.float32, device),
    )


def _allowed_tokens(
    params: tuple[SamplingParams, ...], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    forbidden = torch.ones((len(rows), vocab_size), dtype=torch.bool)  # built once per batch, not inverted per step
    for index, row in enumerate(rows):
        forbidden[index, params[row].allowed_token_ids] = False
    return on_device(rows, torch.int64, device), forbidden.to(device)


def _add_bans(
    metadata: SamplingMetadata, states: list[CachedRequestState], min_tokens_rows: tuple[int, ...],
    bad_words_rows: tuple[int, ...], device: torch.device,
) -> None:
    """The tokens each row may not sample next (``token_bans.py``), for the rows
    with ``min_tokens`` or bad words."""
    banned_by_row: dict[int, set[int]] = {}
    for row in sorted({*min_tokens_rows, *bad_words_rows}):
        state = states[row]
        banned = banned_next_tokens(state.sampling_params, state.eos_token_ids, state.num_output_tokens,
                                    state.output_token_ids)
        if banned:
            banned_by_row[row] = banned
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for row, banned in banned_by_row.items():
        ban_rows.extend([row] * len(banned))
        ban_tokens.extend(sorted(banned))
    if ban_rows:
        metadata.banned_tokens = (
            on_device(ban_rows, torch.int64, device),
            on_device(ban_tokens, torch.int64, device),
        )
