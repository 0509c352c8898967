"""From engine-core token deltas to user-facing ``RequestOutput``s: incremental
detokenization, stop strings, logprobs with decoded tokens, output kinds
(cumulative, delta, final only) and the gathering of ``n > 1`` samples.

A stop string found here finishes the request on this side; the caller must then
abort it in the engine core (``ProcessedOutputs.request_ids_to_abort``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from heron.engine.detokenizer import make_detokenizer
from heron.engine.input_processor import ProcessedPrompt, child_request_id
from heron.engine.stop_strings import StopStringMatcher
from heron.metrics.stats import IterationStats, RequestTimes
from heron.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from heron.sampling_params import RequestOutputKind, SamplingParams
from heron.step_outputs import EngineCoreOutput, TokenLogprobs

# text_at_end requests: detokenize at most this many tokens at a time (bounds the
# burst of host work in one step; a finishing request flushes the rest). Requests
# start their batches at staggered offsets, so that a batch of requests admitted
# together does not detokenize all at once every _TEXT_BATCH steps.
_TEXT_BATCH = 16


@dataclass
class ParentRequest:
    """Gathers the ``n`` samples of one user request."""

    request_id: str
    num_children: int
    finished_children: set[int] = field(default_factory=set)
    final_outputs: dict[int, CompletionOutput] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.finished_children) == self.num_children


class RequestState:
    """Front-end state of one engine request (one sample)."""

    def __init__(
        self,
        engine_request_id: str,
        parent: ParentRequest,
        index: int,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        tokenizer: Any,
        arrival_time: float,
        first_text_batch: int = _TEXT_BATCH,
    ) -> None:
        """``first_text_batch``: for ``text_at_end``, how many tokens the first
        batch detokenizes (1.._TEXT_BATCH, staggered across requests)."""
        self.engine_request_id = engine_request_id
        self.times = RequestTimes(arrival=arrival_time)
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizer = (
            make_detokenizer(tokenizer, prompt.token_ids, params.skip_special_tokens)
            if params.detokenize
            else None
        )
        self.stop_matcher = StopStringMatcher(list(params.stop or []), params.include_stop_str_in_output)
        # Text nobody reads before the end (final-only output, no stop strings) is
        # detokenized in batches of _TEXT_BATCH tokens and at the end, by the same
        # detokenizer over the same tokens, so the text is identical: most steps
        # only keep the token ids, and the per-token Python work (the larger part
        # of the host's work per token at large batches) runs in one tight loop.
        self.text_at_end = (
            self.detokenizer is not None and params.output_kind == RequestOutputKind.FINAL_ONLY
            and not self.stop_matcher.stops
        )
        self.num_detokenized = 0  # text_at_end: tokens whose text is in self.text
        self.next_text_at = first_text_batch  # text_at_end: detokenize once this many tokens are in
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.sent_text_offset = 0
        self.sent_token_offset = 0
        self.sent_logprobs_offset = 0
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, output: EngineCoreOutput) -> bool:
        """Fold in one engine delta; True if a stop string finished the request here."""
        self.num_cached_tokens = output.num_cached_tokens
        self.error = output.error or self.error
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        if output.new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._logprob_dicts(output.new_prompt_logprobs))
        if self.text_at_end:
            self._apply_text_at_end(output)
            return False
        stopped_by_string = False
        # a request the engine stopped on a token (EOS, a stop_token_ids id) keeps it in its token ids, not in its
        # text, unless include_stop_str_in_output (as vLLM: the text of "." as a stop token was in the answer)
        num_text_tokens = len(output.new_token_ids) - int(self._ends_on_stop_token(output))
        for position, token_id in enumerate(output.new_token_ids):
            self.token_ids.append(token_id)
            if output.new_logprobs is not None:
                self._add_logprobs(output.new_logprobs[position])
            if position >= num_text_tokens:
                continue
            if self.detokenizer is not None and self._append_text(self.detokenizer.push(token_id)):
                stopped_by_string = True
                break
        if output.finished and not stopped_by_string:
            if self.detokenizer is not None:
                stopped_by_string = self._append_text(self.detokenizer.flush())
            if not stopped_by_string:
                self.finish_reason = output.finish_reason
                self.stop_reason = output.stop_reason
        return stopped_by_string

    def _apply_text_at_end(self, output: EngineCoreOutput) -> None:
        self.token_ids.extend(output.new_token_ids)
        if output.new_logprobs is not None:
            for entry in output.new_logprobs:
                self._add_logprobs(entry)
        if output.finished or len(self.token_ids) >= self.next_text_at:
            self._catch_up_text(final=output.finished, skip_last=self._ends_on_stop_token(output))
            self.next_text_at = len(self.token_ids) + _TEXT_BATCH
        if output.finished:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason

    def _add_logprobs(self, entry: TokenLogprobs) -> None:
        if self.logprobs is None:
            return
        self.logprobs.extend(self._logprob_dicts([entry]))
        assert self.cumulative_logprob is not None
        self.cumulative_logprob += entry.logprobs[0]

    def _ends_on_stop_token(self, output: EngineCoreOutput) -> bool:
        """Whether the engine stopped the request on its last token (EOS, a
        ``stop_token_ids`` id), whose text is then not the answer's (as vLLM),
        unless ``include_stop_str_in_output``."""
        return (output.finished and output.finish_reason == "stop" and bool(output.new_token_ids)
                and not self.params.include_stop_str_in_output)

    def _catch_up_text(self, final: bool, skip_last: bool = False) -> None:
        """``text_at_end``: push the tokens not yet detokenized (and flush at the
        end), as pushing them one step at a time would have (no stop strings to
        look for, so nothing else happens per token); ``skip_last``: the last is
        a stop token, kept out of the text."""
        assert self.detokenizer is not None
        end = len(self.token_ids) - int(skip_last)
        self.text += self.detokenizer.push_many(self.token_ids[self.num_detokenized : end])
        if final:
            self.text += self.detokenizer.flush()
        self.num_detokenized = len(self.token_ids)

    def _append_text(self, new_text: str) -> bool:
        if not new_text:
            return False
        self.text += new_text
        if len(self.token_ids) <= self.params.min_tokens:
            return False
        match = self.stop_matcher.find(self.text, len(new_text))
        if match is None:
            return False
        stop, cut = match
        self.text = self.text[:cut]
        self.finish_reason = "stop"
        self.stop_reason = stop
        return True

    def _logprob_dicts(self, entries: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        result = []
        for entry in entries:
            item: dict[int, Logprob] = {}
            for position, (token_id, value) in enumerate(zip(entry.token_ids, entry.logprobs)):
                if token_id in item:
                    continue  # the chosen token may also be among the top entries
                rank = entry.rank if position == 0 else position
                item[token_id] = Logprob(value, rank, self.tokenizer.decode([token_id]))
            result.append(item)
        return result

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        # the text that could begin a stop string is held back until it cannot (or the request ends), for whole
        # texts too: a cumulative output used to show it, and then a shorter text when the stop string completed
        text_end = len(self.text) if self.finished else max(
            self.sent_text_offset, len(self.text) - self.stop_matcher.held(self.text)
        )
        if kind == RequestOutputKind.DELTA:
            text = self.text[self.sent_text_offset : text_end]
            token_ids = self.token_ids[self.sent_token_offset :]
            logprobs = self.logprobs[self.sent_logprobs_offset :] if self.logprobs is not None else None
            self.sent_text_offset = text_end
            self.sent_token_offset = len(self.token_ids)
            self.sent_logprobs_offset = len(self.logprobs) if self.logprobs is not None else 0
        else:
            text, token_ids = self.text[:text_end], list(self.token_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
            self.sent_text_offset = text_end
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    request_ids_to_abort: list[str] = field(default_factory=list)
    iteration_stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # by engine request id
        self._num_added = 0  # staggers the text batches of text_at_end requests

    def add_request(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, arrival_time: float | None = None
    ) -> list[str]:
        """Register a user request; returns its engine request ids (one per sample).
        ``arrival_time`` is ``time.monotonic()`` when the request arrived."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = ParentRequest(request_id, params.n)
        engine_ids = []
        for index in range(params.n):
            engine_id = child_request_id(request_id, index) if params.n > 1 else request_id
            child_params = params if params.n == 1 else params.clone(n=1)
            self.requests[engine_id] = RequestState(
                engine_id, parent, index, prompt, child_params, self.tokenizer, arrival,
                first_text_batch=1 + self._num_added % _TEXT_BATCH,
            )
            self._num_added += 1
            engine_ids.append(engine_id)
        return engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str, stats: IterationStats | None = None) -> list[str]:
        """Forget a user request; returns the engine ids to abort in the core. The
        aborted samples are counted as finished ("abort") in ``stats``."""
        engine_ids = [eid for eid, state in self.requests.items() if state.parent.request_id == request_id]
        now = time.monotonic()
        for engine_id in engine_ids:
            state = self.requests.pop(engine_id)
            if stats is not None:
                stats.observe_finished(state.times, "abort", len(state.prompt.token_ids), len(state.token_ids), now)
        return engine_ids

    def process_outputs(self, outputs: list[EngineCoreOutput], timestamp: float | None = None) -> ProcessedOutputs:
        """Fold in one step's outputs; ``timestamp`` (monotonic, the engine core's
        clock, perhaps another machine's) is when the engine produced them."""
        now = time.monotonic()
        result = ProcessedOutputs()
        stats = result.iteration_stats
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue  # aborted by the user, or already stopped by a stop string
            if output.events:
                state.times.apply_events(output.events)
            num_prompt_tokens = len(state.prompt.token_ids)
            served_before = len(state.token_ids)
            if state.apply(output):
                result.request_ids_to_abort.append(output.request_id)
            # the tokens kept: a stop string ends the answer inside a step of several (speculative decoding),
            # and those after it were counted as generated though never served
            stats.observe_tokens(state.times, num_prompt_tokens, len(state.token_ids) - served_before, now, timestamp)
            request_output = self._make_output(state)
            if state.finished:
                del self.requests[output.request_id]
                assert state.finish_reason is not None
                # a request ended with an error (a grammar that failed to compile, a constraint no token
                # meets: answered 400 or 500) is counted as one, not as an abort
                reason = state.finish_reason if state.error is None else "error"
                stats.observe_finished(state.times, reason, num_prompt_tokens, len(state.token_ids), now, timestamp)
            if request_output is not None:
                result.request_outputs.append(request_output)
        return result

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        parent = state.parent
        if finished:
            parent.finished_children.add(state.index)
        if kind == RequestOutputKind.FINAL_ONLY:
            parent.final_outputs[state.index] = state.completion(kind)
            if not parent.finished:
                return None
            completions = [parent.final_outputs[i] for i in sorted(parent.final_outputs)]
        else:
            completions = [state.completion(kind)]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=state.prompt.text,
            prompt_token_ids=state.prompt.token_ids,
            outputs=completions,
            finished=parent.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params,
        )
