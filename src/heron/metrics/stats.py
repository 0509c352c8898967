"""Per-request timing and per-iteration statistics, computed in the front end
from timestamps the engine core records (queued, scheduled, preempted, the
step that made each token) and the front end's own clock. All times are
``time.monotonic()``, of two clocks that need not agree: an engine core may run
on another machine (Ray), whose monotonic clock has another origin. So a span
is only ever taken within one clock: time to first token and end-to-end
latency on the front end's (from the request's arrival there to the output's
processing there, what a client sees), inter-token latency, queue, prefill and
decode times on the engine's (between its own events), as vLLM does."""

from __future__ import annotations

from dataclasses import dataclass, field

from heron.step_outputs import EngineEventType


@dataclass
class RequestTimes:
    arrival: float  # the front end's clock
    # the engine core's clock from here on
    queued: float | None = None
    scheduled: float | None = None  # first scheduling (queue time ends)
    first_token: float | None = None  # the step that made it
    last_token: float | None = None
    num_preemptions: int = 0

    def last_engine_time(self) -> float | None:
        """The latest engine-clock time known (None: no engine event yet)."""
        return next((t for t in (self.last_token, self.first_token, self.scheduled, self.queued) if t is not None),
                    None)

    def apply_events(self, events: list[tuple[int, float]] | None) -> None:
        for event_type, timestamp in events or ():
            if event_type == EngineEventType.QUEUED:
                self.queued = timestamp
            elif event_type == EngineEventType.SCHEDULED and self.scheduled is None:
                self.scheduled = timestamp
            elif event_type == EngineEventType.PREEMPTED:
                self.num_preemptions += 1


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    mean_time_per_output_token: float | None


@dataclass
class IterationStats:
    """What one engine step's outputs contributed."""

    num_prompt_tokens: int = 0  # prompts whose first token arrived this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def observe_tokens(
        self, times: RequestTimes, num_prompt_tokens: int, num_new_tokens: int, now: float,
        engine_now: float | None = None,
    ) -> None:
        """``now``: the front end's time; ``engine_now``: the engine step's time
        that made the tokens (None: one clock, the same as ``now``)."""
        if num_new_tokens == 0:
            return
        engine_now = now if engine_now is None else engine_now
        self.num_generation_tokens += num_new_tokens
        if times.first_token is None:
            times.first_token = engine_now
            self.num_prompt_tokens += num_prompt_tokens
            self.time_to_first_tokens.append(now - times.arrival)
        elif times.last_token is not None:
            self.inter_token_latencies.append(engine_now - times.last_token)
        times.last_token = engine_now

    def observe_finished(
        self, times: RequestTimes, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int, now: float,
        engine_now: float | None = None,
    ) -> None:
        """``engine_now`` None with engine events recorded (an abort seen only by
        the front end): the engine spans end at its last known time."""
        if engine_now is None:
            engine_now = times.last_engine_time()
        end = now if engine_now is None else engine_now  # no engine event at all: nothing but this clock
        scheduled = times.scheduled if times.scheduled is not None else end
        queued = times.queued if times.queued is not None else scheduled
        first = times.first_token if times.first_token is not None else end
        last = times.last_token if times.last_token is not None else end
        decode_time = max(0.0, last - first)
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=max(0.0, now - times.arrival),
                num_prompt_tokens=num_prompt_tokens,
                num_generation_tokens=num_generation_tokens,
                queue_time=max(0.0, scheduled - queued),
                prefill_time=max(0.0, first - scheduled),
                decode_time=decode_time,
                inference_time=max(0.0, last - scheduled),
                mean_time_per_output_token=(
                    decode_time / (num_generation_tokens - 1) if num_generation_tokens > 1 else None
                ),
            )
        )
