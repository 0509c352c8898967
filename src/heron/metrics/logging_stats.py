"""The periodic one-line engine log, like vLLM's:

``Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 95.1 tokens/s,
Running: 8 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 41.0%``

With speculative decoding the line adds the window's draft acceptance rate and
mean accepted length (tokens per verification, counting the target's own token):
``, Spec acceptance rate: 62.5%, Mean acceptance length: 3.50``.
"""

from __future__ import annotations

import logging
import time

from heron.metrics.stats import IterationStats
from heron.step_outputs import SchedulerStats

logger = logging.getLogger("heron.stats")


class LoggingStatLogger:
    def __init__(self, interval_s: float = 10.0, scope: str = "") -> None:
        """``scope``: the requests the throughput counts, when not all the server's
        (each of several API servers counts its own: its line says so)."""
        self.interval_s = interval_s
        self.scope = scope
        self._window_start = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_stats = SchedulerStats()
        self._window_queries = 0
        self._window_hits = 0
        self._window_drafts = 0
        self._window_draft_tokens = 0
        self._window_accepted = 0
        self._last_logged_idle = True

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None) -> None:
        if iteration is not None:
            self._prompt_tokens += iteration.num_prompt_tokens
            self._generation_tokens += iteration.num_generation_tokens
        if scheduler_stats is not None:
            self._window_queries += max(0, scheduler_stats.prefix_cache_queries - self._last_stats.prefix_cache_queries)
            self._window_hits += max(0, scheduler_stats.prefix_cache_hits - self._last_stats.prefix_cache_hits)
            last = self._last_stats
            self._window_drafts += max(0, scheduler_stats.spec_num_drafts - last.spec_num_drafts)
            self._window_draft_tokens += max(0, scheduler_stats.spec_num_draft_tokens - last.spec_num_draft_tokens)
            self._window_accepted += max(0, scheduler_stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens)
            self._last_stats = scheduler_stats

    def maybe_log(self, now: float | None = None) -> str | None:
        """Log (and return) the line if the interval passed; idle periods log once."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._window_start
        if elapsed < self.interval_s:
            return None
        stats = self._last_stats
        idle = (
            self._prompt_tokens == 0
            and self._generation_tokens == 0
            and stats.num_running_reqs == 0
            and stats.num_waiting_reqs == 0
        )
        line = None
        if not (idle and self._last_logged_idle):
            hit_rate = self._window_hits / self._window_queries if self._window_queries else 0.0
            line = (
                (f"{self.scope}: " if self.scope else "")
                + f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
                f"KV cache usage: {stats.kv_cache_usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}"
            )
            if self._window_draft_tokens:
                line += (
                    f", Spec acceptance rate: {self._window_accepted / self._window_draft_tokens:.1%}, "
                    f"Mean acceptance length: {1 + self._window_accepted / self._window_drafts:.2f}"
                )
            logger.info(line)
        self._last_logged_idle = idle
        self._window_start = now
        self._prompt_tokens = self._generation_tokens = 0
        self._window_queries = self._window_hits = 0
        self._window_drafts = self._window_draft_tokens = self._window_accepted = 0
        return line
