"""A request as the engine core sees it: token ids, progress, and status.

Invariants (docs/architecture.md, the one scheduling rule):

* ``all_token_ids`` = prompt + output so far; draft tokens live apart in
  ``spec_token_ids`` and count only in ``num_tokens_with_spec``.
* ``num_computed_tokens`` <= ``num_tokens_with_spec`` is how many of those tokens
  have their K/V in the cache (or are scheduled to, in the current step).
* With async scheduling, ``num_output_placeholders`` output tokens are being
  sampled by steps still in flight: scheduled and counted in
  ``num_computed_tokens``, but not yet in ``all_token_ids``.
* ``block_hashes[i]`` is the chained hash of full block ``i`` of ``all_token_ids``;
  the KV manager extends it as blocks fill.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from heron.sampling_params import SamplingParams
from heron.step_outputs import TokenLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()  # its prefix is being loaded from a KV offload tier
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # everything after this is finished
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the engine could not serve it (a KV load that failed under policy "fail")

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class EngineCoreRequest:
    """What the front end hands the engine core: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int  # resolved: never exceeds max_model_len - len(prompt)
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None


class Request:
    """Engine-core state of one sequence (one of the ``n`` of a prompt)."""

    def __init__(self, core_request: EngineCoreRequest) -> None:
        self.request_id = core_request.request_id
        self.sampling_params = core_request.sampling_params
        self.eos_token_ids = frozenset(core_request.eos_token_ids)
        self.max_tokens = core_request.max_tokens
        self.priority = core_request.priority
        self.cache_salt = core_request.cache_salt
        self.arrival_time = core_request.arrival_time
        self.num_prompt_tokens = len(core_request.prompt_token_ids)
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.all_token_ids: list[int] = list(core_request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []
        self.num_output_placeholders = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit, set at first scheduling
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # prompt tokens (from the second on) whose logprobs were reported: a prompt computed again after a
        # preemption scores them again, and only the ones past this are news
        self.num_prompt_logprobs_reported = 0
        self.remote_prefill_tried = False  # its kv_transfer_params' blocks were pulled (or tried)
        # its blocks may enter the prefix cache (False: its prefix came from a peer no one vouched for, so
        # nothing it holds, pulled or computed after, is given to other requests)
        self.shares_cache = True
        # lifecycle events not yet reported: (EngineEventType, time.monotonic())
        self.events: list[tuple[int, float]] = []

    def unreported_prompt_logprobs(self, start: int, entries: list[TokenLogprobs]) -> list[TokenLogprobs] | None:
        """The prompt logprobs of a step whose chunk started at position ``start``
        (they score prompt tokens ``start + 1`` on) that were not reported yet.
        After a preemption the prompt is computed, and scored, again from its
        start: reporting those again gave a client hundreds of entries for a
        short prompt."""
        skip = max(0, self.num_prompt_logprobs_reported - start)
        self.num_prompt_logprobs_reported = max(self.num_prompt_logprobs_reported, start + len(entries))
        return entries[skip:] or None

    def record_event(self, event_type: int, timestamp: float | None = None) -> None:
        self.events.append((event_type, time.monotonic() if timestamp is None else timestamp))

    def take_events(self) -> list[tuple[int, float]] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
