"""Top-k and top-p over a batch of logits, without sorting the vocabulary where
that can be avoided.

What a row keeps: its ``top_k`` largest logits and every logit tied with the
k-th; of those, the most likely tokens until their probability reaches
``top_p`` (at least one), and every logit tied with the last one kept. Keeping
ties whole makes the kept set a function of the row alone: a sort orders tied
logits as it likes, and a seeded request's tokens would then depend on its
batch (bfloat16 logits tie often).

Ways to the same set:

* candidates: a row's top-k among its ``max_top_k`` largest logits (one
  ``topk``), and the top-p cut-off among those too, the probabilities taken
  over every logit top-k keeps. No host sync where ``max_top_k`` is passed.
* top-p alone on the CPU: the cut-off among the 1,024 largest logits when they
  hold ``top_p`` of the probability (the usual case for a trained model); a
  row whose candidates fall short is sorted. The check reads the host, which
  costs nothing there; on a GPU it would stall the device queue, so there the
  sort does it;
* the sort: the whole vocabulary sorted once per step, for any mix of rows.

Top-k 50 with top-p 0.95 took 5.8 ms a step through the sort and 0.6 through
the candidates on a 2-core Zen 3 (vocabulary 49,152, batch 1), 1.33 and 0.45 ms
on an H100 (vocabulary 128,256, batch 64); BENCHMARKS.md, "Sampling without a
sort of the vocabulary"."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")

# above this many candidates a full sort of the vocabulary is as cheap as top-k
_MAX_TOP_K_CANDIDATES = 1024
# how many of a row's largest logits top-p alone looks at before it sorts the row
_TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """``logits`` with what each row does not keep (module docstring) set to -inf.

    ``top_k`` holds the vocabulary size where a row has none, ``top_p`` 1.0.
    ``max_top_k`` (the largest ``top_k``, known on the host) lets rows that all
    use top-k work on their candidates without the device waiting on a host
    read of ``top_k``."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    if top_k is not None:
        if max_top_k is None:
            max_top_k = int(top_k.max())  # (a host sync: callers on the device path pass it)
        if max_top_k <= _MAX_TOP_K_CANDIDATES and max_top_k < vocab_size:
            candidates = logits.topk(max_top_k, dim=-1).values  # descending
            cutoff = candidates.gather(1, (top_k - 1).clamp(min=0, max=max_top_k - 1)[:, None])
            if top_p is not None:
                cutoff, _ = _top_p_cutoff(candidates, cutoff, top_p, logits)
            return logits.masked_fill(logits < cutoff, _NEG_INF)
    elif top_p is not None and logits.device.type == "cpu" and vocab_size > _TOP_P_CANDIDATES:
        return _top_p_through_candidates(logits, top_p)
    return _sorted_top_k_top_p(logits, top_k, top_p)


def _top_p_cutoff(
    candidates: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor, logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's smallest kept logit after top-p, among ``candidates`` (its
    largest logits, descending) at or above ``floor`` (its top-k's k-th, or
    -inf), the probabilities taken over every logit of ``logits`` at or above
    ``floor`` (None: the candidates are the whole row, sorted); and whether the
    row kept every candidate (then, under top-p alone, the cut-off may lie
    past them). Rows at top_p 1 keep everything at or above ``floor``.

    The probability mass is summed in float64, so the sort's way and the
    candidates' agree at a cut-off (a float32 softmax and cumulative sum over
    the vocabulary were off by 1e-5, and a seeded row's kept set followed its
    batch's way)."""
    row_max = candidates[:, :1]
    above_floor = (candidates >= floor) & (candidates > _NEG_INF)  # a banned token is never kept
    weights = torch.where(above_floor, (candidates - row_max).exp(), 0.0)
    if logits is None:
        total = weights.sum(dim=-1, keepdim=True, dtype=torch.float64)
    else:
        total = torch.where(logits >= floor, (logits - row_max).exp(), 0.0).sum(dim=-1, keepdim=True,
                                                                                dtype=torch.float64)
    probs = weights.double() / total
    mass_before = probs.cumsum(dim=-1) - probs
    whole = top_p[:, None] >= 1.0  # their sums reach 1.0 before the tail ends: a mask would cut the tail
    kept = above_floor & ((mass_before < top_p[:, None]) | whole)
    cutoff = torch.where(kept, candidates, torch.inf).amin(dim=-1, keepdim=True)
    cutoff = torch.where(whole, floor, torch.minimum(cutoff, row_max))  # the most likely token always stays
    return cutoff, kept[:, -1] & ~whole[:, 0]


def _top_p_through_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p alone: the cut-off among each row's largest logits, and the sort for
    the rows whose candidates hold less than ``top_p`` (reads the host)."""
    candidates = logits.topk(_TOP_P_CANDIDATES, dim=-1).values
    floor = torch.full((logits.shape[0], 1), _NEG_INF, dtype=logits.dtype, device=logits.device)
    cutoff, short = _top_p_cutoff(candidates, floor, top_p, logits)
    kept = logits.masked_fill(logits < cutoff, _NEG_INF)
    rows = short.nonzero().flatten()
    if len(rows):
        kept[rows] = _sorted_top_k_top_p(logits[rows], None, top_p[rows])
    return kept


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Any mix of rows, through one sort of the vocabulary."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    cutoff = sorted_logits[:, -1:]
    if top_k is not None:
        cutoff = sorted_logits.gather(1, (top_k - 1).clamp(min=0, max=logits.shape[1] - 1)[:, None])
    if top_p is not None:
        cutoff, _ = _top_p_cutoff(sorted_logits, cutoff, top_p)
    return logits.masked_fill(logits < cutoff, _NEG_INF)
