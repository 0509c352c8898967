"""The n-gram proposer (prompt lookup decoding).

For a request whose tokens end in ``s`` (its last ``n`` tokens, ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``), find the latest earlier
place where ``s`` occurs and propose the ``k`` tokens that followed it (a
match that runs into the end, in a loop, proposes the loop repeated). Input
copying workloads (editing, summarising, code changes, retrieval answers) match
often; the longest matching ``n`` wins.

Matching is vectorised with numpy: all windows of length ``n`` are compared
against the suffix at once, so the cost is a few array operations per request
per step, with no Python loop over the sequence.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Drafts for one sequence (prompt + output so far), at most
        ``min(k, max_drafts)``; [] when no n-gram of the allowed sizes recurs."""
        limit = self.k if max_drafts is None else min(self.k, max_drafts)
        length = len(token_ids)
        if limit <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n :]
            # windows starting at 0 .. length - n - 1: each is followed by a token
            windows = sliding_window_view(token_ids[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: the freshest context
                if start + limit <= length:
                    return token_ids[start : start + limit].tolist()
                # the match runs into the end (a loop): what followed it ends in the suffix again, so what
                # follows now is that again; cut at the end, a loop of one token drafted one token a step
                return np.resize(token_ids[start:], limit).tolist()
        return []
