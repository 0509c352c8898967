"""msgpack encoding of what crosses the API-server / engine-core boundary.

Messages are ``(kind, payload)`` pairs. Dataclasses travel as positional lists
(compact and fast); the decoders rebuild them. Only plain types cross: ints,
floats, strings, lists, dicts (int keys allowed).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, fields
from typing import Any

import msgpack

from heron.request import EngineCoreRequest
from heron.sampling_params import RequestOutputKind, SamplingParams
from heron.step_outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats, TokenLogprobs


class MessageKind(enum.IntEnum):
    # API server -> engine core
    ADD = 1
    ABORT = 2
    UTILITY = 3
    SHUTDOWN = 4
    # engine core -> API server
    READY = 10
    OUTPUTS = 11
    UTILITY_RESULT = 12
    FAILED = 13
    HEARTBEAT = 14  # every second from a thread of its own, with how long the current step has run
    LOAD_FAILED = 15  # at start, from the model's files or the arguments: the user's to fix (heron: error, exit 2)


# An engine core's exit code after LOAD_FAILED: the message may go unread (no API server connected yet within
# the socket's linger, or one told of the exit first), the code is not lost
LOAD_FAILED_EXIT_CODE = 2


_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]
_STATS_FIELDS = [f.name for f in fields(SchedulerStats)]


def pack(kind: MessageKind, payload: Any) -> bytes:
    return msgpack.packb((int(kind), payload), use_bin_type=True)


def unpack(data: bytes) -> tuple[MessageKind, Any]:
    kind, payload = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return MessageKind(kind), payload


def encode_sampling_params(params: SamplingParams) -> list[Any]:
    values = [getattr(params, name) for name in _SAMPLING_FIELDS]
    values[_SAMPLING_FIELDS.index("output_kind")] = params.output_kind.value
    if params.structured_outputs is not None:  # decoded back by SamplingParams itself
        constraint = asdict(params.structured_outputs)
        if isinstance(constraint["json"], dict):
            # a schema travels as its text: JSON numbers may pass 64 bits, which msgpack cannot carry
            constraint["json"] = json.dumps(constraint["json"])
        values[_SAMPLING_FIELDS.index("structured_outputs")] = constraint
    return values


def decode_sampling_params(values: list[Any]) -> SamplingParams:
    kwargs = dict(zip(_SAMPLING_FIELDS, values))
    kwargs["output_kind"] = RequestOutputKind(kwargs["output_kind"])
    return SamplingParams(**kwargs)


def encode_request(request: EngineCoreRequest) -> list[Any]:
    return [
        request.request_id,
        request.prompt_token_ids,
        encode_sampling_params(request.sampling_params),
        list(request.eos_token_ids),
        request.max_tokens,
        request.arrival_time,
        request.priority,
        request.cache_salt,
    ]


def decode_request(values: list[Any]) -> EngineCoreRequest:
    request_id, prompt, params, eos, max_tokens, arrival, priority, salt = values
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=decode_sampling_params(params),
        eos_token_ids=tuple(eos),
        max_tokens=max_tokens,
        arrival_time=arrival,
        priority=priority,
        cache_salt=salt,
    )


def _encode_logprobs(entries: list[TokenLogprobs] | None) -> list[Any] | None:
    if entries is None:
        return None
    return [[e.token_ids, e.logprobs, e.rank] for e in entries]


def _decode_logprobs(values: list[Any] | None) -> list[TokenLogprobs] | None:
    if values is None:
        return None
    return [TokenLogprobs(ids, lps, rank) for ids, lps, rank in values]


def encode_outputs(outputs: EngineCoreOutputs) -> list[Any]:
    stats = outputs.scheduler_stats
    return [
        [
            [
                o.request_id,
                o.new_token_ids,
                _encode_logprobs(o.new_logprobs),
                _encode_logprobs(o.new_prompt_logprobs),
                o.finish_reason,
                o.stop_reason,
                o.num_cached_tokens,
                o.events,
                o.kv_transfer_params,
                o.error,
            ]
            for o in outputs.outputs
        ],
        None if stats is None else [getattr(stats, name) for name in _STATS_FIELDS],
        outputs.timestamp,
    ]


def decode_outputs(values: list[Any]) -> EngineCoreOutputs:
    raw_outputs, raw_stats, timestamp = values
    outputs = [
        EngineCoreOutput(
            request_id=rid,
            new_token_ids=tokens,
            new_logprobs=_decode_logprobs(logprobs),
            new_prompt_logprobs=_decode_logprobs(prompt_logprobs),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_cached_tokens=cached,
            events=[tuple(e) for e in events] if events else None,
            kv_transfer_params=kv_params,
            error=error,
        )
        for rid, tokens, logprobs, prompt_logprobs, finish_reason, stop_reason, cached, events, kv_params, error
        in raw_outputs
    ]
    stats = None if raw_stats is None else SchedulerStats(**dict(zip(_STATS_FIELDS, raw_stats)))
    return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=timestamp)
