"""Batched logits processing: penalties, min-p, and sampling with per-row random
generators (top-k and top-p are in ``top_k_top_p``). All are tensor ops over the
batch; none loops over the vocabulary in Python."""

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


def sample_from_probs(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Draw one token per row: argmax(probs / E) with E ~ Exp(1) is a draw from
    ``probs`` (the exponential race). Rows with their own generator draw their noise
    from it, so a seeded request samples the same tokens whatever its batch; the
    others share the engine's generator.

    On the CPU, E is -log(U) of a uniform draw: torch's ``exponential_`` took
    1.53 ms for one row of a 49,152-token vocabulary on a Zen 3 core, the
    uniform draw and the logarithm 0.42 ms (benchmarks/sampler_ops_time.py).
    U is a multiple of 2^-24 in [0, 1): U = 0 gives E = 1e30 (not inf), so that
    token all but loses this draw yet still beats the tokens of probability 0
    (a row of one possible token keeps it), and E is never below
    -log(1 - 2^-24). (-log(1 - U) made U = 0 an E of 0, and its token, of
    whatever probability, won: 0.3% of the draws over a 49,152-token
    vocabulary.) A GPU keeps ``exponential_``: one pass over the noise, not two."""
    noise = torch.empty_like(probs)
    on_cpu = probs.device.type == "cpu"
    if len(generators) < probs.shape[0]:
        _draw(noise, default_generator, on_cpu)
    for row, generator in generators.items():
        _draw(noise[row], generator, on_cpu)
    if on_cpu:
        noise.log_().neg_().clamp_(max=1e30)
    return probs.div(noise).argmax(dim=-1)


def _draw(noise: torch.Tensor, generator: torch.Generator | None, uniform: bool) -> None:
    if uniform:
        noise.uniform_(generator=generator)
    else:
        noise.exponential_(generator=generator)
