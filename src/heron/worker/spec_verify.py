"""Verify one step's draft tokens in the model runner.

A request verifying ``k`` drafts has ``k + 1`` logits rows. Each row is sampled
with the sampling state the request would have at that position without
speculation (the drafts before it count as output: penalties, ``min_tokens``
bans, the seeded generator's position), then the rejection sampler decides how
many drafts survive and which target token follows them.
"""

from __future__ import annotations

import dataclasses

import torch

from heron.sample.rejection import RejectionSampler
from heron.sample.sampler import gather_logprobs
from heron.step_outputs import TokenLogprobs
from heron.worker.request_state import CachedRequestState
from heron.worker.sampling_metadata import build_sampling_metadata


def row_states(state: CachedRequestState, drafts: list[int], device: torch.device) -> list[CachedRequestState]:
    """The request as seen from each of its ``len(drafts) + 1`` rows. Seeded
    requests get a generator per row (each is reseeded for its own position)."""
    rows = [state]
    for j in range(1, len(drafts) + 1):
        generator = torch.Generator(device=device) if state.generator is not None else None
        rows.append(dataclasses.replace(state, token_ids=state.token_ids + drafts[:j], generator=generator))
    return rows


def verify_drafts(
    rejection_sampler: RejectionSampler,
    logits: torch.Tensor,
    states: list[CachedRequestState],
    drafts: list[list[int]],
    vocab_size: int,
    device: torch.device,
    draft_probs: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """``logits``: each state's ``len(drafts[i]) + 1`` rows together, in order.
    Returns per state the emitted tokens (accepted drafts + one target token) and,
    where asked, their logprobs (from the raw logits, like plain sampling)."""
    per_row = [row for state, ds in zip(states, drafts) for row in row_states(state, ds, device)]
    metadata = build_sampling_metadata(per_row, vocab_size, device)
    result = rejection_sampler(logits, metadata, drafts, draft_probs)
    logprobs: list[list[TokenLogprobs] | None] = [None] * len(states)
    if metadata.max_num_logprobs is not None:
        rows = [row for rows in result.rows for row in rows]
        chosen = torch.tensor([t for tokens in result.token_ids for t in tokens], dtype=torch.int64, device=device)
        raw = torch.log_softmax(logits[torch.tensor(rows, device=device)], dim=-1)
        entries = gather_logprobs(raw, chosen, metadata.max_num_logprobs).token_logprobs()
        cursor = 0
        for index, (state, tokens) in enumerate(zip(states, result.token_ids)):
            num_top = state.sampling_params.logprobs
            if num_top is not None:
                logprobs[index] = [entry.top(num_top) for entry in entries[cursor : cursor + len(tokens)]]
            cursor += len(tokens)
    return result.token_ids, logprobs
