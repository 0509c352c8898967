"""What the model runner returns for one step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprobs for one position: ``token_ids[0]`` is the chosen (sampled or prompt)
    token, the rest are the top-N alternatives, best first; ``rank`` is the chosen
    token's 1-based rank in the whole vocabulary."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


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
