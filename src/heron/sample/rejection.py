"""The rejection sampler: verify draft tokens so that the output distribution is
exactly the target model's.

A request with ``k`` drafts ``d_1..d_k`` has ``k + 1`` logits rows: row ``j``
is the target's distribution ``p_j`` for the token after ``d_1..d_j`` (row 0:
after the last verified token). Walking ``j = 0, 1, ...``:

* greedy rows accept ``d_{j+1}`` while it is the argmax of ``p_j``; the first
  mismatch outputs the argmax instead;
* random rows with a draft distribution ``q_j`` accept ``d_{j+1}`` with
  probability ``min(1, p_j(d) / q_j(d))``; the first rejection outputs a draw
  from ``max(p_j - q_j, 0)`` renormalised. This is the standard speculative
  sampling rule (Leviathan et al. 2023, Chen et al. 2023): the token emitted at
  every position is distributed exactly as ``p_j``;
* random rows with certain drafts (an n-gram copy, a greedy draft model:
  ``q_j(d) = 1``) draw ``x ~ p_j`` exactly as sampling without speculation
  would, with the row's own noise, and accept ``d_{j+1}`` when ``x`` is it, else
  emit ``x``. That is the rule above for ``q = 1`` (accepted with probability
  ``p_j(d)``; a rejection's ``x`` is a draw from ``p_j`` without ``d``), and a
  seeded request's tokens are then the ones it gets without speculation,
  whatever its batch: its noise depends only on its seed and the position,
  where a uniform for the test and then the residual's draw took two draws
  from the row's generator (and which rows had drafts changed with the batch).

If every draft is accepted, the last row gives one more ("bonus") token, so a
step emits between 1 and ``k + 1`` tokens.

Each row's logits are processed with the row's own history (the drafts before
it count as output tokens for penalties and ``min_tokens``), so the rows are
exactly what sampling without speculation would have used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.sample.metadata import SamplingMetadata
from heron.sample.ops import sample_from_probs
from heron.sample.sampler import Sampler


@dataclass
class RejectionOutput:
    # per request: accepted drafts followed by one target token
    token_ids: list[list[int]]
    # the target's row chosen for each emitted token: rows[i][t] (for logprobs)
    rows: list[list[int]]


class RejectionSampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for rows without a seed of their own

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: list[list[int]],
        draft_probs: torch.Tensor | None = None,
    ) -> RejectionOutput:
        """``logits``: ``[sum(k_i + 1), V]``, each request's rows together, in
        order; ``metadata``: one row per logits row; ``draft_probs``: the draft
        model's distributions, one row per draft token (None: certain drafts)."""
        device = logits.device
        num_drafts = [len(drafts) for drafts in draft_token_ids]
        first_row = [0]
        for k in num_drafts:
            first_row.append(first_row[-1] + k + 1)
        draft_rows = torch.tensor(
            [first_row[i] + j for i, k in enumerate(num_drafts) for j in range(k)], dtype=torch.int64, device=device
        )
        drafts = torch.tensor([t for ds in draft_token_ids for t in ds], dtype=torch.int64, device=device)

        processed = Sampler._process(logits, metadata)
        target_argmax = processed.argmax(dim=-1)
        greedy_row = (
            torch.ones(len(logits), dtype=torch.bool, device=device)
            if metadata.all_greedy
            else metadata.temperature <= 0
        )
        # accepted[j]: draft j survives its row (before the first rejection rule)
        accepted = target_argmax[draft_rows] == drafts
        # what each row emits if the walk stops there: the argmax for greedy rows,
        # a draw from the residual (draft rows) or from p (bonus rows) otherwise
        emitted = target_argmax.clone()
        if not metadata.all_greedy:
            probs = Sampler.probabilities(processed, metadata)
            if draft_probs is None:
                drawn = sample_from_probs(probs, metadata.generators, self.generator)
                random_accept = drawn[draft_rows] == drafts
            else:
                random_accept, drawn = self._against_draft_probs(probs, metadata, draft_rows, drafts, draft_probs)
            accepted = torch.where(greedy_row[draft_rows], accepted, random_accept)
            emitted = torch.where(greedy_row, target_argmax, drawn)

        accepted_list = accepted.tolist()
        emitted_list = emitted.tolist()
        draft_index = 0
        token_ids: list[list[int]] = []
        rows: list[list[int]] = []
        for request_index, k in enumerate(num_drafts):
            base = first_row[request_index]
            num_accepted = 0
            while num_accepted < k and accepted_list[draft_index + num_accepted]:
                num_accepted += 1
            draft_index += k
            row = base + num_accepted
            token_ids.append(draft_token_ids[request_index][:num_accepted] + [emitted_list[row]])
            rows.append(list(range(base, row + 1)))
        return RejectionOutput(token_ids, rows)

    def _against_draft_probs(
        self,
        probs: torch.Tensor,
        metadata: SamplingMetadata,
        draft_rows: torch.Tensor,
        drafts: torch.Tensor,
        draft_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per draft whether it is accepted (``u < min(1, p / q)``), and per row
        what it emits when the walk stops there: a draw from the residual
        ``max(p - q, 0)`` (draft rows) or from ``p`` (bonus rows)."""
        uniform = _uniform(len(probs), metadata.generators, self.generator, probs.device)
        draft_p = probs[draft_rows, drafts]
        draft_q = draft_probs[torch.arange(len(drafts), device=probs.device), drafts]
        accepted = uniform[draft_rows] * draft_q < draft_p
        residual = probs.clone()
        residual[draft_rows] = (probs[draft_rows] - draft_probs).clamp(min=0)
        # a residual of all zeros only happens where the draft is always accepted
        residual = residual / residual.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        return accepted, sample_from_probs(residual, metadata.generators, self.generator)


def _uniform(
    num_rows: int,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """One U[0, 1) per row; seeded rows draw from their own generator."""
    uniform = torch.empty(num_rows, device=device)
    if len(generators) < num_rows:
        uniform.uniform_(generator=default_generator)
    for row, generator in generators.items():
        uniform[row : row + 1].uniform_(generator=generator)
    return uniform
