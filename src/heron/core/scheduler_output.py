"""What the scheduler decides each step, as the model runner needs it.

The model runner keeps its own per-request state (token ids, block table, sampling
state), so the scheduler sends full data only for requests the runner has not
seen (new, or resumed after preemption) and a diff (new block ids, progress) for
the others. This keeps the runner independent of the scheduler's ``Request``
objects, as it must be once runners live in other processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from heron.core.kv_offload import KVTransfers
from heron.request import Request
from heron.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt + any output (a request resumed after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int

    @staticmethod
    def from_request(request: Request, block_ids: list[int]) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            eos_token_ids=request.eos_token_ids,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )


@dataclass
class CachedRequestData:
    """Requests the runner already holds, in parallel lists."""

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def add(self, request_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.request_ids.append(request_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # request id -> tokens granted this step, in batch order (running first)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # request id -> draft tokens to verify this step (speculative decoding)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # requests that finished or were aborted since the last step
    finished_req_ids: set[str] = field(default_factory=set)
    # requests preempted this step (they return later as new requests)
    preempted_req_ids: set[str] = field(default_factory=set)
    # KV offload copies to make before the forward pass (None: no offload tier)
    kv_transfers: KVTransfers | None = None

    def num_computed_before(self, request_id: str) -> int:
        """A scheduled request's computed tokens when this step was scheduled."""
        for new in self.scheduled_new_reqs:
            if new.request_id == request_id:
                return new.num_computed_tokens
        cached = self.scheduled_cached_reqs
        return cached.num_computed_tokens[cached.request_ids.index(request_id)]

    @property
    def forgotten_req_ids(self) -> set[str]:
        """Requests whose state the runner drops: finished or preempted."""
        return self.finished_req_ids | self.preempted_req_ids

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
