"""What the engine core reports after each step: per-request deltas plus the
scheduler's statistics (for metrics and the periodic log)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from heron.worker.runner_output import TokenLogprobs


class EngineEventType(enum.IntEnum):
    """Request lifecycle events, stamped with ``time.monotonic()`` in the engine core
    (CLOCK_MONOTONIC is system-wide, so the API process can compare them)."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id, when one ended it
    num_cached_tokens: int = 0
    # lifecycle events since the last output: (EngineEventType, monotonic time)
    events: list[tuple[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    num_preemptions: int = 0  # cumulative
    num_scheduled_tokens: int = 0  # this step
    # speculative decoding, cumulative
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.monotonic() when the step's tokens were ready
