"""Small builders shared by the tests."""

from __future__ import annotations

import itertools

from heron.request import EngineCoreRequest, Request
from heron.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(
    num_tokens: int,
    *,
    request_id: str | None = None,
    token_offset: int = 0,
    token_ids: list[int] | None = None,
    max_tokens: int = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    eos_token_ids: tuple[int, ...] = (2,),
    **params: object,
) -> Request:
    """A request whose prompt is ``token_offset, token_offset + 1, ...`` unless
    ``token_ids`` is given."""
    index = next(_ids)
    prompt = token_ids if token_ids is not None else [1000 + token_offset + i for i in range(num_tokens)]
    return Request(
        EngineCoreRequest(
            request_id=request_id or f"req-{index}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
            eos_token_ids=eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=float(index) if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )
    )
