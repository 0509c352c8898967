"""The scheduler: one rule for prefill, chunked prefill, decode, prefix hits,
speculative verification and recompute after preemption (docs/architecture.md).

Each step, every request is granted new tokens so that ``num_computed_tokens``
catches up with its token count (``num_tokens_with_spec``), within a per-step token
budget (``max_num_batched_tokens``) and a cap on running sequences
(``max_num_seqs``). Running requests are served first, in order; when the KV pool
cannot hold a running request's new tokens, the lowest-priority running request
(FCFS: the most recently admitted) is preempted: its blocks are freed and it goes
back to the waiting queue to be recomputed later. Waiting requests are then
admitted in queue order, with a cached prefix skipped and a prompt longer than the
remaining budget chunked.

With async scheduling the next step is scheduled before the current one reports
its sampled tokens: a request that samples gets an output placeholder, which
the next step schedules like a known token (its input id comes from the device);
the placeholder is replaced when the output arrives. Stops are therefore seen a
step late — a finished request's extra step is discarded — and max_tokens is
respected ahead by counting placeholders.

Requests whose prefix is loaded in the background (disk tier, prefill engine)
and leases on finished prefills are the KV-connector half, ``core/scheduler_kv.py``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from heron.config import CacheConfig, KVTransferConfig, SchedulerConfig
from heron.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from heron.core.kv_disk_layout import DiskTierLayout
from heron.core.request_queue import create_request_queue
from heron.core.scheduler_kv import SchedulerKVMixin
from heron.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from heron.request import Request, RequestStatus
from heron.step_outputs import EngineCoreOutput, EngineCoreOutputs, EngineEventType, ModelRunnerOutput, SchedulerStats
from heron.token_bans import NO_TOKEN_LEFT, no_token_left

if TYPE_CHECKING:
    from heron.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodingCounters:
    """Cumulative speculative-decoding counts (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # verifications: one per request per step with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens


@dataclass
class _StepPlan:
    """What ``schedule()`` has granted so far in one step."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # in batch order
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_ids: set[str] = field(default_factory=set)
    # running requests granted tokens -> their newly allocated block ids
    running_block_ids: dict[str, list[int]] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)

    def grant(self, request: Request, num_new: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new
        self.token_budget -= num_new

    def take_back(self, request: Request) -> None:
        """Undo a running request's grant, if it had one (it was preempted later in
        the step; one passed over, its last token in flight, was granted nothing)."""
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id, 0)
        self.spec_tokens.pop(request.request_id, None)
        self.running_block_ids.pop(request.request_id, None)


class Scheduler(SchedulerKVMixin):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        structured_output_manager: StructuredOutputManager | None = None,
        num_lookahead_tokens: int = 0,
        async_scheduling: bool = False,
        enable_kv_events: bool = False,
        num_offload_blocks: int = 0,
        disk_layout: DiskTierLayout | None = None,
        kv_block_bytes: int = 0,
        kv_transfer: KVTransferConfig | None = None,
    ) -> None:
        """``kv_block_bytes``: one pool block's bytes (the host tier's statistics)."""
        self.config = scheduler_config
        self.kv_block_bytes = kv_block_bytes
        self.async_scheduling = async_scheduling
        # slots allocated past the scheduled tokens (a draft model writes its
        # speculative K/V there)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.structured_output = structured_output_manager
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_kv_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            enable_kv_events=enable_kv_events,
            num_offload_blocks=num_offload_blocks,
            disk_layout=disk_layout,
            disk_max_bytes=cache_config.kv_offloading_dir_bytes,
            max_model_len=max_model_len,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self._init_kv_connector(cache_config, kv_transfer)
        # forgotten by the runner at the next step
        self._finished_req_ids: set[str] = set()
        self._sampling_in_last_step: set[str] = set()  # async: requests the last scheduled step gave a placeholder
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingCounters()
        self._failed_requests: list[Request] = []  # grammar or KV-load failures, reported at the next output
        self._failure_errors: dict[str, str | None] = {}  # a failed request's reason, for its client
        # unfinished requests whose sampling reads their previous token on the host
        self._num_needing_latest_tokens = 0

    # ---- request lifecycle -------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self._leases or rid in self.loading:  # held: a lease, a load
            raise ValueError(f"request id {rid!r} is already in use")
        self.requests[rid] = request
        self._num_needing_latest_tokens += request.sampling_params.needs_latest_tokens
        self.waiting.add(request)
        request.record_event(EngineEventType.QUEUED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; their blocks are freed at
        once. Unknown or already finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            self._remove_from_queue(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _remove_from_queue(self, request: Request) -> None:
        """Take an unfinished request (or one finished just now) off its queue
        (one loading stays in ``loading`` until the worker is done)."""
        if request in self.running:
            self.running.remove(request)
        elif request.request_id not in self.loading:
            self.waiting.remove(request)

    def _free_request(self, request: Request, keep_blocks: bool = False) -> None:
        """``keep_blocks``: leased to a decode engine (freed by ``release_leases``)."""
        self._num_needing_latest_tokens -= request.sampling_params.needs_latest_tokens
        self._release_unpulled(request)
        if self.structured_output is not None:
            self.structured_output.remove_request(request.request_id)
        if request.request_id not in self.loading and not keep_blocks:  # else freed when its load is done
            self.kv_cache_manager.free(request)
            self._holding.pop(request.request_id, None)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Also while blocks are being loaded (an aborted request's are freed when
        that is done) or are leased to decode engines."""
        return self.num_unfinished_requests > 0 or bool(self.loading) or bool(self._leases)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the current one's output
        is known: async scheduling is on and no unfinished request needs its
        previous token on the host to be sampled."""
        return self.async_scheduling and self._num_needing_latest_tokens == 0

    # ---- scheduling --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One step's grants: running requests first, in order (preempting when
        the pool is short), then waiting ones unless this step had to preempt
        (the pool is full)."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        self.kv_pool_short = False
        self._schedule_running(plan)
        if not plan.preempted_ids:
            self._schedule_waiting(plan, time.monotonic())
        self.kv_pool_short |= bool(plan.preempted_ids)
        return self._emit(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            num_new = self._num_running_tokens(request, plan.token_budget)
            if num_new <= 0:
                index += 1
                continue
            new_blocks, index = self._allocate_or_preempt(request, num_new, index, plan)
            if new_blocks is None:
                continue  # it preempted itself; ``index`` now points at the next one
            plan.grant(request, num_new)
            plan.running_block_ids[request.request_id] = new_blocks.get_block_ids()
            if request.spec_token_ids:
                num_spec = num_new + request.num_computed_tokens - request.num_tokens
                if num_spec > 0:
                    plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            index += 1

    def _num_running_tokens(self, request: Request, token_budget: int) -> int:
        """Tokens a running request may compute this step (<= 0: none)."""
        if request.num_output_placeholders and (
            request.num_output_tokens + request.num_output_placeholders >= request.max_tokens
        ):
            return 0  # the token in flight is its last one
        return min(
            request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens,
            token_budget,
            self.max_model_len - 1 - request.num_computed_tokens,
        )

    def _allocate_or_preempt(
        self, request: Request, num_new: int, index: int, plan: _StepPlan
    ) -> tuple[KVCacheBlocks | None, int]:
        """Slots for ``num_new`` tokens of ``self.running[index]``, preempting
        victims until they fit. Returns the new blocks (None: the request
        preempted itself) and the request's index after the preemptions; a victim
        granted tokens earlier this step gives them back."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if new_blocks is not None:
                return new_blocks, index
            if self._release_held_blocks():
                continue  # waiting requests give their loaded blocks back before running ones are preempted
            victim = self._pick_preemption_victim()
            victim_index = self.running.index(victim)
            self._preempt(victim)
            plan.preempted_ids.add(victim.request_id)
            if victim is request:
                return None, index
            if victim_index < index:
                index -= 1
                plan.take_back(victim)

    def _schedule_waiting(self, plan: _StepPlan, now: float) -> None:
        """Admit waiting requests in queue order while the budget, the sequence
        cap and the pool allow; requests not ready yet keep their place."""
        not_ready: list[Request] = []
        while len(self.waiting) > 0 and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.num_output_placeholders or (
                request.sampling_params.structured_outputs is not None and not self._grammar_ready(request)
            ):
                # preempted while its last token was in flight, or its grammar still compiles
                not_ready.append(self.waiting.pop())  # after peek: this request
                continue
            admitted = self._admit(request, plan, now)
            if admitted is None:  # the disk tier is still looking its prefix up
                not_ready.append(self.waiting.pop())
                continue
            if not admitted and not self._release_held_blocks(keep=request):
                break
        for request in reversed(not_ready):
            if request.is_finished:  # its grammar failed to compile
                self._free_request(request)
            else:
                self.waiting.add_preempted(request)

    def _admit(self, request: Request, plan: _StepPlan, now: float) -> bool | None:
        """Move the head of the waiting queue to running with its cached prefix
        and a (possibly chunked) grant, or to ``loading`` when its prefix goes on
        on disk; False when it does not fit; None when the disk tier does not know
        yet how far its prefix goes (it stays at the head of the queue)."""
        computed_blocks: KVCacheBlocks | None = None
        loaded = self.kv_cache_manager.has_blocks(request.request_id)  # its prefix, from disk
        if loaded:
            num_hit_tokens = request.num_computed_tokens
        else:
            remote = self._start_remote_load(request)
            if remote is not None:
                self.kv_pool_short |= not remote
                return remote
            computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if computed_blocks.lookup_pending:
                return None
            if computed_blocks.needs_load:
                started = self._start_load(request, computed_blocks, num_hit_tokens)
                self.kv_pool_short |= not started
                if started:
                    self.kv_cache_manager.record_lookup(request, computed_blocks)
                return started
        num_new = request.num_tokens - num_hit_tokens
        if num_new > plan.token_budget:
            if not self.config.enable_chunked_prefill:
                return False
            num_new = plan.token_budget
        new_blocks = self.kv_cache_manager.allocate_slots(
            request,
            num_new,
            new_computed_blocks=computed_blocks,
            num_new_computed_tokens=0 if loaded else num_hit_tokens,
            num_lookahead_tokens=self.num_lookahead_tokens,
        )
        if new_blocks is None:
            self.kv_pool_short = True
            return False
        if computed_blocks is not None:
            self.kv_cache_manager.record_lookup(request, computed_blocks)
        self.waiting.pop()
        self._holding.pop(request.request_id, None)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.record_event(EngineEventType.SCHEDULED, now)
        plan.grant(request, num_new)
        plan.new_reqs.append(
            NewRequestData.from_request(request, self.kv_cache_manager.get_block_ids(request.request_id))
        )
        return True

    def _emit(self, plan: _StepPlan) -> SchedulerOutput:
        """The step's output. The step will compute what was granted: progress
        advances now, so the next ``schedule()`` sees it even before this step's
        output is processed."""
        cached_reqs = CachedRequestData()
        for request_id, new_block_ids in plan.running_block_ids.items():
            cached_reqs.add(request_id, new_block_ids, self.requests[request_id].num_computed_tokens)
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=plan.spec_tokens,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=plan.preempted_ids,
            kv_transfers=self.kv_cache_manager.take_transfers(),
        )
        self._finished_req_ids = set()
        self._sampling_in_last_step = set()
        for request_id, num_new in plan.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_new
            if (
                self.async_scheduling
                and request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1  # this step samples its next token
                self._sampling_in_last_step.add(request_id)
        return output

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a structured request's grammar is compiled. One whose grammar
        failed to compile is finished as aborted (reported at the next output) and
        counts as not ready; the caller takes it off the waiting queue."""
        assert self.structured_output is not None
        ready = self.structured_output.is_ready(request)
        if ready is None:
            request.status = RequestStatus.FINISHED_ABORTED
            self._failed_requests.append(request)
            self._failure_errors[request.request_id] = self.structured_output.take_error(request.request_id)
            return False
        return ready

    def structured_requests_to_sample(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Structured requests scheduled this step that sample a token (their
        grammar masks the logits), in batch order."""
        if self.structured_output is None:
            return []
        ids = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[request_id]
            if (
                request.sampling_params.structured_outputs is not None
                and request.num_computed_tokens >= request.num_tokens
            ):
                ids.append(request_id)
        return ids

    def _pick_preemption_victim(self) -> Request:
        if self.config.policy == "priority":
            # the lowest priority, then the latest arrival, then the latest admitted (an n > 1 request's samples
            # share priority and arrival: max alone picked the earliest admitted, as no policy asks)
            position = max(range(len(self.running)),
                           key=lambda i: (self.running[i].priority, self.running[i].arrival_time, i))
            return self.running[position]
        return self.running[-1]

    def abandon_step(self, scheduler_output: SchedulerOutput) -> None:
        """A step that raised before it computed (an interrupt in the forward
        pass, offline): progress advanced when it was scheduled, and its full
        blocks were registered in the prefix cache, though their K/V was never
        written. Each of its requests gives the step back and is preempted: the
        blocks leave the prefix cache, and it is recomputed if it goes on. (The
        same prompt answered garbage from the cached blocks after a Ctrl-C.)
        With async scheduling the step is the last one scheduled: the output
        placeholder it gave a request goes too, and a request with an earlier
        step's token still in flight is preempted all the same (that token is
        appended when its step's output is processed, as after any preemption;
        skipping such a request left the blocks of the step that completed a
        prompt cached unwritten)."""
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request not in self.running:
                continue
            request.num_computed_tokens -= num_new
            if request_id in self._sampling_in_last_step:
                request.num_output_placeholders -= 1
            self._preempt(request)
        self._sampling_in_last_step = set()

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request, request.num_computed_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.record_event(EngineEventType.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.add_preempted(request)
        logger.debug("preempted %s", request.request_id)

    # ---- step results --------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, apply stop rules, and report per-request deltas."""
        outputs: list[EngineCoreOutput] = []
        for row, request_id in enumerate(runner_output.req_ids):
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished (aborted) while the step ran
            sampled = runner_output.sampled_token_ids[row]
            if sampled and request.num_output_placeholders:
                request.num_output_placeholders -= 1
            num_draft = len(scheduler_output.scheduled_spec_decode_tokens.get(request_id, ()))
            if num_draft:
                # accepted drafts + 1 target token were sampled; the rest were rejected
                request.num_computed_tokens -= num_draft + 1 - len(sampled)
                self.spec_stats.observe(num_draft, len(sampled) - 1)
            request.spec_token_ids = []
            logprobs = runner_output.logprobs[row] if runner_output.logprobs else None
            prompt_logprobs = runner_output.prompt_logprobs.get(request_id)
            if prompt_logprobs:
                start = scheduler_output.num_computed_before(request_id)
                prompt_logprobs = request.unreported_prompt_logprobs(start, prompt_logprobs)
            new_token_ids: list[int] = []
            structured = self.structured_output is not None and request.sampling_params.structured_outputs is not None
            for token_id in sampled:
                if structured and not self._grammar_accepts(request, token_id):
                    break
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if structured and self._grammar_finished(request):
                    break
                if self._check_stop(request) or self._no_token_left(request):
                    break
            if logprobs is not None:
                logprobs = logprobs[: len(new_token_ids)]
            kv_transfer_params = self._lease(request) if request.is_finished else None
            if new_token_ids or prompt_logprobs or request.is_finished or request.events:
                outputs.append(
                    EngineCoreOutput(
                        request_id=request_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=logprobs,
                        new_prompt_logprobs=prompt_logprobs,
                        finish_reason=request.status.finish_reason,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        events=request.take_events(),
                        kv_transfer_params=kv_transfer_params,
                        error=self._failure_errors.pop(request_id, None) if request.is_finished else None,
                    )
                )
            if request.is_finished:
                # (an async step may report a request preempted since: it waits)
                self._remove_from_queue(request)
                self._free_request(request, keep_blocks=kv_transfer_params is not None)
            elif request_id in runner_output.draft_token_ids:
                # a step emits at most 1 + drafts tokens: never propose past max_tokens
                room = request.max_tokens - request.num_output_tokens - 1
                request.spec_token_ids = runner_output.draft_token_ids[request_id][: max(room, 0)]
        outputs.extend(self.take_failure_outputs())
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(scheduler_output), timestamp=time.monotonic()
        )

    def take_failure_outputs(self) -> list[EngineCoreOutput]:
        """Final outputs of the requests failed since the last call (grammar, KV load)."""
        outputs = [EngineCoreOutput(failed.request_id, [], finish_reason=failed.status.finish_reason,
                                    num_cached_tokens=max(failed.num_cached_tokens, 0),
                                    error=self._failure_errors.pop(failed.request_id, None))
                   for failed in self._failed_requests]
        self._failed_requests.clear()
        return outputs

    def _grammar_accepts(self, request: Request, token_id: int) -> bool:
        """Advance the request's grammar by the token; False (the request is
        finished, the token not kept) if the grammar forbids it: the step's mask
        left no token at all. The request's own restrictions can do that (its
        allowed_token_ids or bad_words exclude every token the grammar allows):
        where the output is complete and only its end was excluded, it stops
        there; else it is the client's error, answered as such (it was a 500
        "engine error"); anything else is a bug."""
        assert self.structured_output is not None
        if self.structured_output.accept(request.request_id, token_id):
            return True
        params = request.sampling_params
        if any(self.structured_output.accept(request.request_id, eos) for eos in request.eos_token_ids):
            request.status = RequestStatus.FINISHED_STOPPED  # complete: only the end was not allowed
        elif params.allowed_token_ids is not None or params.bad_words_token_ids:
            request.status = RequestStatus.FINISHED_ABORTED
            self._failure_errors[request.request_id] = (
                "no token is left that both the output constraint and the request's allowed_token_ids or bad_words "
                "allow")
        else:
            logger.error("%s sampled token %d that its grammar forbids", request.request_id, token_id)
            request.status = RequestStatus.FINISHED_ERROR
        return False

    def _no_token_left(self, request: Request) -> bool:
        """Whether the request's own restrictions leave its next token no choice
        (``token_bans.py``: a bad word of several tokens can ban the last one of
        its allowed_token_ids once the output ends in the rest); it is then
        finished with the reason, as for a grammar (its row was all -inf, and
        token 0 came out). A grammar's request is the grammar's to end."""
        params = request.sampling_params
        if params.allowed_token_ids is None or params.structured_outputs is not None:
            return False
        if not no_token_left(params, request.eos_token_ids, request.output_token_ids):
            return False
        request.status = RequestStatus.FINISHED_ABORTED
        self._failure_errors[request.request_id] = NO_TOKEN_LEFT
        return True

    def _grammar_finished(self, request: Request) -> bool:
        """Whether the request's grammar is complete (the request then finishes)."""
        assert self.structured_output is not None
        if self.structured_output.is_terminated(request.request_id):
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        last_token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last_token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last_token in params.stop_token_ids:  # type: ignore[operator]
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last_token
                return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def make_stats(self, scheduler_output: SchedulerOutput | None = None) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.loading),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            **self._offload_stats(),
            num_scheduled_tokens=(
                scheduler_output.total_num_scheduled_tokens if scheduler_output else 0
            ),
        )

    def _offload_stats(self) -> dict[str, int]:
        manager = self.kv_cache_manager
        stats: dict[str, int] = {}
        for tier, index in (("host", manager.offload), ("disk", manager.disk)):
            if index is not None:
                counts = index.stats
                stats.update({f"kv_{tier}_stored": counts.stored, f"kv_{tier}_loaded": counts.loaded,
                              f"kv_{tier}_evicted": counts.evicted, f"kv_{tier}_hit_tokens": counts.hit_tokens,
                              f"kv_{tier}_blocks": len(index)})
        if manager.offload is not None:
            stats["kv_host_bytes"] = len(manager.offload) * self.kv_block_bytes
        if manager.disk is not None:
            stats["kv_disk_load_failures"] = manager.disk.stats.load_failures
            stats["kv_disk_bytes"] = len(manager.disk) * manager.disk.layout.file_bytes
        return stats

