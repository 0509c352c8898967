"""What one engine step produces, in types every layer may import: the model
runner's output (sampled tokens, logprobs, drafts) and the engine core's
per-request deltas and scheduler statistics, which cross the process boundary
to the API server (``engine/serialization.py``)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprobs:
    """Logprobs for one position: ``token_ids[0]`` is the chosen (sampled or prompt)
    token, the rest are the top-N alternatives, best first; ``rank`` is the chosen
    token's 1-based rank in the whole vocabulary."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int

    def top(self, num_top: int) -> TokenLogprobs:
        """The chosen token and its ``num_top`` best alternatives only."""
        return TokenLogprobs(self.token_ids[: num_top + 1], self.logprobs[: num_top + 1], self.rank)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # per request: the tokens sampled this step ([] while a prompt is still being
    # prefilled in chunks; several with speculative decoding)
    sampled_token_ids: list[list[int]]
    # per request, per sampled token; None where the request did not ask
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    # request id -> logprobs of the prompt positions computed this step
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> draft tokens proposed for the next step (speculative decoding)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class PendingRunnerOutput:
    """The output of a step still running on the device (async scheduling): its
    sampled ids are being copied to the host; ``get()`` waits for that copy (not
    for later steps) and returns the step's ``ModelRunnerOutput``."""

    def __init__(self, resolve: Callable[[], ModelRunnerOutput]) -> None:
        self._resolve: Callable[[], ModelRunnerOutput] | None = resolve
        self._output: ModelRunnerOutput | None = None

    def get(self) -> ModelRunnerOutput:
        if self._resolve is not None:
            self._output, self._resolve = self._resolve(), None
        assert self._output is not None
        return self._output


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
    # a finished prefill's blocks, leased to a decode engine (core/scheduler_kv.py)
    kv_transfer_params: dict[str, Any] | None = None
    # why the engine ended the request, where the client can act on it (a constraint that did not compile)
    error: str | None = None

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
    # the step processed just before this one in the same call (async scheduling: a step in flight, then one
    # that could not be scheduled ahead): its tokens, so that the iteration histogram sees both steps
    earlier_step_tokens: int = 0
    # speculative decoding, cumulative
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # the KV offload tiers (host memory, disk), cumulative (blocks; hits in prompt
    # tokens), and the blocks each holds now
    kv_host_stored: int = 0
    kv_host_loaded: int = 0
    kv_host_evicted: int = 0
    kv_host_hit_tokens: int = 0
    kv_host_blocks: int = 0
    kv_host_bytes: int = 0
    kv_disk_stored: int = 0
    kv_disk_loaded: int = 0
    kv_disk_evicted: int = 0
    kv_disk_hit_tokens: int = 0
    kv_disk_blocks: int = 0
    kv_disk_bytes: int = 0
    kv_disk_load_failures: int = 0


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.monotonic() when the step's tokens were ready
