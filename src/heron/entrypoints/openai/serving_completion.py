"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from heron.engine.input_processor import InvalidRequestError, ProcessedPrompt
from heron.entrypoints.openai.errors import bad_request
from heron.entrypoints.openai.logprob_fields import (
    MIN_LOGPROB,
    TextOffsets,
    check_prompt_logprobs,
    completion_token_label,
    prompt_logprobs_field,
)
from heron.entrypoints.openai.off_loop import prepare
from heron.entrypoints.openai.protocol import CompletionRequest
from heron.entrypoints.openai.serving_common import (
    ServingContext,
    check_constraints,
    check_kv_transfer_params,
    check_request,
    constraint_param,
    final_outputs,
    invalid_input,
    kv_transfer_field,
    merge_streams,
    name_constraint_errors,
    request_ids,
    resolve_max_tokens,
    sampling_params,
    sse,
    sse_stream,
    start_generation,
    streaming_response,
    usage,
)
from heron.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs


def _prompts(request: CompletionRequest) -> list[Any]:
    """One prompt or several (the request model has bounded the list: ``limits.py``)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _process(ctx: ServingContext, request: CompletionRequest, prompt: Any) -> ProcessedPrompt:
    processor = ctx.engine.input_processor
    try:
        if isinstance(prompt, str) and not request.add_special_tokens and prompt:
            return ProcessedPrompt(prompt, processor.tokenizer.encode(prompt, add_special_tokens=False))
        processed = processor.process_prompt(prompt)
    except InvalidRequestError as exc:
        raise invalid_input(exc) from exc
    if processed.text is None:
        processed = ProcessedPrompt(processor.tokenizer.decode(processed.token_ids), processed.token_ids)
    return processed


async def create_completion(ctx: ServingContext, request: CompletionRequest, raw_request: Request) -> Any:
    check_request(ctx, request, request.model)
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of must equal n (heron returns every sample)", "best_of")
    prompts = await prepare(raw_request, lambda: [_process(ctx, request, p) for p in _prompts(request)])
    check_kv_transfer_params(ctx, request, len(prompts))
    check_prompt_logprobs(request.prompt_logprobs, request.stream)
    scores_only = request.max_tokens == 0
    if scores_only and not request.echo:
        raise bad_request("max_tokens 0 asks for the prompt alone, scored: it needs echo true", "max_tokens")
    prompt_logprobs = request.prompt_logprobs
    if request.echo and request.logprobs is not None:  # the echoed prompt's logprobs, top-N as asked by logprobs
        prompt_logprobs = max(request.logprobs, prompt_logprobs if prompt_logprobs is not None else 0)
    params = [
        sampling_params(
            request,
            # the engine samples one token past the prompt, which the answer leaves out
            resolve_max_tokens(ctx, len(p.token_ids), 1 if scores_only else request.max_tokens, "max_tokens",
                               "prompt"),
            request.logprobs,
            prompt_logprobs,
            request.stream,
        )
        for p in prompts
    ]
    request_id, engine_id = request_ids(request.request_id, "cmpl")
    created = int(time.time())
    param = constraint_param(request, False)
    await check_constraints(params, param)
    try:
        streams = start_generation(ctx, prompts, params, engine_id, request.priority, request.cache_salt)
    except InvalidRequestError as exc:
        raise invalid_input(exc) from exc
    streams = name_constraint_errors(streams, params, param)
    builder = _CompletionBuilder(ctx, request, prompts, request_id, created)
    if request.stream:
        return streaming_response(ctx, builder.stream(streams), engine_id, len(prompts))
    return JSONResponse(builder.response(await final_outputs(ctx, raw_request, streams)))


class _CompletionBuilder:
    def __init__(
        self,
        ctx: ServingContext,
        request: CompletionRequest,
        prompts: list[ProcessedPrompt],
        request_id: str,
        created: int,
    ) -> None:
        self.ctx = ctx
        self.request = request
        self.prompts = prompts
        self.request_id = request_id
        self.created = created
        self.tokenizer = ctx.engine.tokenizer

    def _kept(self, completion: CompletionOutput) -> CompletionOutput:
        """The completion as the answer has it: with max_tokens 0 (the prompt alone),
        the token the engine sampled past the prompt is no part of it."""
        if self.request.max_tokens != 0:
            return completion
        return replace(completion, text="", token_ids=[], logprobs=[], cumulative_logprob=None,
                       finish_reason="length" if completion.finished() else None, stop_reason=None)

    def _choice(self, prompt_index: int, completion: CompletionOutput, prompt_logprobs: PromptLogprobs | None,
                echo_prompt: bool, offsets: TextOffsets | None = None) -> dict[str, Any]:
        """``offsets``: where this choice's next token starts (a stream keeps one
        per choice: its text sent so far is no guide, stop strings hold some back)."""
        text = completion.text
        logprobs = None
        prompt = self.prompts[prompt_index]
        if echo_prompt:
            text = (prompt.text or "") + text
        if self.request.logprobs is not None:
            logprobs = self._logprobs(
                completion.token_ids,
                completion.logprobs or [],
                prompt.token_ids if echo_prompt else None,
                prompt_logprobs if echo_prompt else None,
                offsets or TextOffsets(self.tokenizer, 0),
            )
        choice = {
            "index": prompt_index * self.request.n + completion.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if self.request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(prompt_logprobs, prompt.token_ids,
                                                              self.request.prompt_logprobs)
        return choice

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: SampleLogprobs,
        prompt_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        offset: TextOffsets,
    ) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        pairs: list[tuple[int, dict[int, Any] | None]] = []
        if prompt_ids is not None:
            entries = prompt_logprobs or [None] * len(prompt_ids)
            pairs += list(zip(prompt_ids, entries))
        pairs += list(zip(token_ids, logprobs))
        num_top = self.request.logprobs or 0
        num_prompt = len(prompt_ids) if prompt_ids is not None else 0
        for position, (token_id, entry) in enumerate(pairs):
            text = self.tokenizer.decode([token_id])
            tokens.append(completion_token_label(self.tokenizer, token_id, text))
            # the answer's text leaves out special tokens (skip_special_tokens): they take no room in it either
            in_answer = text
            if position >= num_prompt and self.request.skip_special_tokens:
                in_answer = self.tokenizer.decode([token_id], skip_special_tokens=True)
            offsets.append(offset.advance(token_id, in_answer))
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(max(entry[token_id].logprob, MIN_LOGPROB))
            # the top `logprobs` and the token itself (OpenAI: "up to logprobs+1 elements"): cutting the ranked
            # entries at `logprobs` dropped a sampled token ranked below them
            ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
            top.append({
                completion_token_label(self.tokenizer, tid, lp.decoded_token): max(lp.logprob, MIN_LOGPROB)
                for place, (tid, lp) in enumerate(ranked) if place < num_top or tid == token_id
            })
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for prompt_index, output in enumerate(finals):
            prompt_tokens += len(output.prompt_token_ids)
            cached += output.num_cached_tokens
            for completion in map(self._kept, output.outputs):
                completion_tokens += len(completion.token_ids)
                choices.append(self._choice(prompt_index, completion, output.prompt_logprobs, self.request.echo))
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.served_model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached),
            **kv_transfer_field(finals[0]),
        }

    def stream(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncGenerator[str, None]:
        options = self.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        n = self.request.n
        completion_tokens = [0] * (len(self.prompts) * n)
        text_offsets = [TextOffsets(self.tokenizer, 0) for _ in range(len(self.prompts) * n)]
        echoed: set[int] = set()
        cached = [0] * len(self.prompts)
        prompt_total = sum(len(p.token_ids) for p in self.prompts)

        async def chunks() -> AsyncGenerator[str, None]:
            async with aclosing(merge_streams(streams)) as merged:
                async for prompt_index, output in merged:
                    cached[prompt_index] = output.num_cached_tokens
                    for completion in map(self._kept, output.outputs):
                        index = prompt_index * n + completion.index
                        echo = self.request.echo and index not in echoed
                        echoed.add(index)
                        if (
                            not completion.text
                            and not completion.token_ids
                            and completion.finish_reason is None
                            and not echo
                        ):
                            continue
                        completion_tokens[index] += len(completion.token_ids)
                        choice = self._choice(prompt_index, completion, output.prompt_logprobs, echo,
                                              text_offsets[index])
                        chunk = self._chunk([choice])
                        if continuous:
                            chunk["usage"] = usage(prompt_total, sum(completion_tokens), sum(cached))
                        yield sse(chunk)

        def closing() -> str | None:
            if not include_usage:
                return None
            chunk = self._chunk([])
            chunk["usage"] = usage(prompt_total, sum(completion_tokens), sum(cached))
            return sse(chunk)

        return sse_stream(self.ctx, chunks(), closing)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.served_model_name,
            "choices": choices,
        }

