"""The batched sampler.

Steps, in order, over the logits of all rows to sample (float32 ``[N, V]``):

1. logprobs, if any row asked, from the raw logits (vLLM's default "raw" mode):
   the top-N and the eventually sampled token's logprob and rank;
2. logit bias, then ``allowed_token_ids`` and bans (EOS and stop ids of rows
   still under ``min_tokens``, a bad word's last token where the output ends
   in the rest of it);
3. repetition, frequency and presence penalties;
4. greedy rows take the argmax of the processed logits;
5. other rows: temperature, min-p, top-k, top-p, then a draw with the row's
   generator (its own if the request has a seed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.sample.metadata import SamplingMetadata
from heron.sample.ops import apply_min_p, apply_penalties, sample_from_probs
from heron.sample.top_k_top_p import apply_top_k_top_p
from heron.step_outputs import TokenLogprobs


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # present when some row asked for logprobs; row r's top entries are
    # logprob_token_ids[r, 1:] (sorted), column 0 is the sampled token
    logprob_token_ids: torch.Tensor | None = None  # [N, 1 + max_num_logprobs]
    logprobs: torch.Tensor | None = None  # [N, 1 + max_num_logprobs]
    sampled_ranks: torch.Tensor | None = None  # [N], 1-based

    def token_logprobs(self) -> list[TokenLogprobs]:
        """Every row's logprobs on the host, with all the columns computed (trim a
        row to what its request asked for with ``TokenLogprobs.top``)."""
        assert self.logprob_token_ids is not None and self.logprobs is not None and self.sampled_ranks is not None
        rows = zip(self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.sampled_ranks.tolist())
        return [TokenLogprobs(ids, values, rank) for ids, values, rank in rows]


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for rows without a seed of their own

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if metadata.max_num_logprobs is not None else None
        )
        logits = self._process(logits, metadata)
        sampled = self._sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return gather_logprobs(raw_logprobs, sampled, int(metadata.max_num_logprobs or 0))

    @staticmethod
    def _process(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.logit_bias is not None:
            rows, token_ids, values = metadata.logit_bias
            logits = logits.index_put((rows, token_ids), values, accumulate=True)
        if metadata.allowed_tokens is not None:
            rows, forbidden = metadata.allowed_tokens
            logits = logits.clone() if metadata.logit_bias is None else logits  # index_put made a copy already
            logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
        if metadata.banned_tokens is not None:
            rows, token_ids = metadata.banned_tokens
            # (torch.full fills on the device; torch.tensor(..., device=) would copy and wait)
            logits = logits.index_put((rows, token_ids), torch.full((), float("-inf"), device=logits.device))
        if metadata.has_penalties:
            logits = apply_penalties(
                logits,
                metadata.output_token_ids,
                metadata.prompt_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        return logits

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=-1) if not metadata.all_random else None
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        sampled = sample_from_probs(self.probabilities(logits, metadata), metadata.generators, self.generator)
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature > 0, sampled, greedy)

    @staticmethod
    def probabilities(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row draws from: processed logits with
        temperature, min-p, top-k and top-p applied (greedy rows: temperature 1)."""
        temperature = torch.where(metadata.temperature > 0, metadata.temperature, 1.0)
        scaled = logits / temperature[:, None]
        if metadata.min_p is not None:
            scaled = apply_min_p(scaled, metadata.min_p)
        scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p, metadata.max_top_k)
        return torch.softmax(scaled, dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int
) -> SamplerOutput:
    """Column 0: the chosen tokens' logprobs; columns 1..num_top: the top entries."""
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        token_ids = torch.cat((chosen[:, None], top_ids), dim=1)
        values = torch.cat((chosen_logprobs, top_logprobs), dim=1)
    else:
        token_ids, values = chosen[:, None], chosen_logprobs
    return SamplerOutput(chosen, token_ids, values, ranks)
