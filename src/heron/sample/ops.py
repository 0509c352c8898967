"""Batched logits processing: penalties, temperature, min-p, top-k, top-p, and
sampling with per-row random generators. All are tensor ops over the batch; none
loops over the vocabulary in Python."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] int counts of each token id in each row's list."""
    num_rows = len(token_ids)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=device)
    max_len = max((len(ids) for ids in token_ids), default=0)
    if max_len == 0:
        return counts[:, :vocab_size]
    padded = torch.full((num_rows, max_len), vocab_size, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        if ids:
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    padded = padded.to(device, non_blocking=True)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition divides positive (multiplies negative)
    logits of tokens seen in the prompt or output; frequency subtracts
    ``penalty * count`` and presence subtracts ``penalty`` for tokens in the output."""
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size, logits.device)
    if repetition is not None:
        seen = output_counts > 0
        seen |= token_counts(prompt_token_ids, vocab_size, logits.device) > 0
        penalty = repetition[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if frequency is not None:
        logits = logits - frequency[:, None] * output_counts
    if presence is not None:
        logits = logits - presence[:, None] * (output_counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, _NEG_INF)


# above this many candidates a full sort of the vocabulary is as cheap as top-k
_MAX_TOP_K_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (and every logit tied with the
    k-th) and, of those, the smallest set of most likely tokens whose
    probability reaches ``top_p`` (at least one).

    ``max_top_k`` (the largest ``top_k``, known on the host) lets a batch whose
    rows all use top-k and none top-p find each row's k-th largest among its
    candidates instead of sorting the vocabulary, and keeps the device from
    waiting on a host read of ``top_k``. Both ways give a row the same tokens,
    whatever its batch."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    if top_k is not None and top_p is None:
        if max_top_k is None:
            max_top_k = int(top_k.max())  # (a host sync: callers on the device path pass it)
        if max_top_k <= _MAX_TOP_K_CANDIDATES and max_top_k < vocab_size:
            # the k-th largest of each row from its candidates; every logit tied with it stays, as in the sorted
            # path below (keeping exactly k let the batch decide which tied token a seeded row could draw)
            values = logits.topk(max_top_k, dim=-1).values  # descending
            kth_largest = values.gather(1, (top_k - 1).clamp(min=0, max=max_top_k - 1)[:, None])
            return logits.masked_fill(logits < kth_largest, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (top_k - 1).clamp(min=0, max=vocab_size - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, _NEG_INF)
    if top_p is not None:
        sorted_logits = _mask_top_p_descending(sorted_logits, top_p)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _mask_top_p_descending(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask, in logits sorted best first, every token whose more likely tokens
    already hold ``top_p`` of the probability (the first one always stays)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # rows at top_p 1 keep everything: their float32 sums reach 1.0 before the tail ends, and masked it (a
    # seeded row's tokens then depended on whether another row of its batch used top_p)
    return sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0), _NEG_INF)


def sample_from_probs(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Draw one token per row: argmax(probs / E) with E ~ Exp(1) is a draw from
    ``probs`` (the exponential race). Rows with their own generator draw their noise
    from it, so a seeded request samples the same tokens whatever its batch; the
    others share the engine's generator."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_(generator=default_generator)
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return probs.div(noise).argmax(dim=-1)
