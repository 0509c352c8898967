"""What users get back, in vLLM's shapes: ``RequestOutput`` with one
``CompletionOutput`` per sample, and per-token ``Logprob`` dictionaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the vocabulary
    decoded_token: str | None = None


# one dict per token: token id -> Logprob (the chosen token and the top-N)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id
    error: str | None = None  # why the engine aborted it, where the client can act on it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # a finished prefill's blocks, for a decode engine (prefill/decode disaggregation)
    kv_transfer_params: dict[str, Any] | None = None
