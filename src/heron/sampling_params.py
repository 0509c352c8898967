"""Sampling parameters of one request, with vLLM's names and semantics.

``SamplingParams.validate`` checks every value and raises ``ValueError`` naming the
parameter, so bad input fails before any work is done.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

# The most top logprobs a request may ask for (per sampled token or prompt token).
MAX_LOGPROBS = 20
# Integers the engine carries in 64-bit fields (msgpack to the engine core, int64
# tensors there): a top_k past them stopped the engine core.
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
_INTEGER_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# The sampler works in float32: a temperature past float32's range became inf
# (a banned token's -inf / inf is NaN: the whole row NaN, token 0 "sampled"), and a
# repetition penalty near 0 divided a logit into inf. Within these bounds every
# logit stays finite; beyond them sampling is already uniform or one-hot.
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
_EPS = 1e-5


class SamplingParamError(ValueError):
    """A sampling parameter has an invalid value; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's names). Exactly one of: a JSON schema (dict or
    string), a regular expression, a list of choices, an EBNF grammar, or any JSON
    object (``json_object=True``).

    JSON may carry whitespace between tokens, at most a few characters in a row
    (small models otherwise fall into endless runs of newlines or tabs);
    ``disable_any_whitespace=True`` makes it compact (``{"a": 1, "b": 2}``)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        # set, not truthy: an empty schema ({}: any JSON) is given, and is sent to the engine core as the
        # text "{}", where truthiness differs; the two sides must count alike (a request the API server
        # passed and the core refused stopped the core)
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamError(
                "structured_outputs",
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        for name in ("regex", "grammar"):  # a list or dict here was a 500 (unhashable, in the grammar cache)
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise SamplingParamError("structured_outputs", f"structured_outputs.{name} must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise SamplingParamError(
                "structured_outputs", "structured_outputs.choice must be a non-empty list of strings"
            )

    def key(self) -> tuple[str, str]:
        """(kind, specification) — what identifies a compiled grammar. JSON kinds
        become ``json-compact`` when whitespace is disabled."""
        import json as json_module

        suffix = "-compact" if self.disable_any_whitespace else ""
        if self.json is not None:
            # key order matters: the output follows the schema's property order
            return "json" + suffix, self.json if isinstance(self.json, str) else json_module.dumps(self.json)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json_module.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object" + suffix, ""


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # only the finished output is produced (offline generate)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} on a
    # prefill engine; what its answer carried, on a decode engine
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: only these tokens may be sampled
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated; the front end tokenizes them into bad_words_token_ids (each word with
    # and without a leading space), whose last token is banned where the output ends in the others
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self._plain_numbers()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_latest_tokens(self) -> bool:
        """Whether sampling the next token reads the previous one on the host
        (penalties count output tokens, a grammar must accept it first): such a
        request cannot be scheduled before its previous token is known."""
        return self.has_penalties or self.structured_outputs is not None

    def _plain_numbers(self) -> None:
        """numpy's integers and floats (a per-prompt seed drawn with numpy) as
        Python's: they were refused as "must be a 64-bit signed integer, got
        np.int64(3)"."""
        for name in _INTEGER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (int, float, bool)):
                setattr(self, name, float(value))

    def validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise SamplingParamError(param, f"{param} {message}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not isinstance(getattr(self, name), (int, float)) or not math.isfinite(getattr(self, name)):
                fail(name, f"must be a finite number, got {getattr(self, name)!r}")  # NaN passes every comparison
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            fail("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= INT64_MAX:
            fail("top_k", f"must be -1 or 0 (disabled) or a positive integer below 2**63, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            fail("repetition_penalty", f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.stop and not self.detokenize:  # they are matched on text: they were ignored without a word
            fail("stop", "needs detokenize (stop strings are matched on the text)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX):
            fail("seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        assert isinstance(self.stop, list)
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            fail("stop_token_ids", "must be non-negative integers")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            fail("logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            fail("allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            fail("bad_words", "must be non-empty strings")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in the vocabulary."""
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamError(
                    "logit_bias", f"logit_bias has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}"
                )
        for name in ("stop_token_ids", "allowed_token_ids"):
            outside = [t for t in getattr(self, name) or [] if t >= vocab_size]
            if outside:
                raise SamplingParamError(name, f"{name} outside the vocabulary (size {vocab_size}): {outside[:5]}")

    def clone(self, **changes: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["stop"] = list(self.stop or [])
        values["stop_token_ids"] = list(self.stop_token_ids or [])
        values["logit_bias"] = dict(self.logit_bias) if self.logit_bias else None
        for name in ("allowed_token_ids", "bad_words", "bad_words_token_ids"):
            if values[name] is not None:
                values[name] = list(values[name])
        values.update(changes)
        return SamplingParams(**values)
