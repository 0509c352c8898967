"""The limits a request to ``heron serve`` must keep within (README: "Request
limits"). Past one, the request gets a 400 in OpenAI's error shape naming the
parameter (413 for the body, 431 for the headers).

Limits that are part of the API's contract are constants here: the request
models in ``protocol.py`` carry them as field constraints, so the OpenAPI
schema the server publishes (``/openapi.json``) states exactly what it
enforces. Limits that depend on the deployment are flags: the body and header
sizes (``cli_args.py``) and the context length (``max_tokens``, checked
against the prompt by the handlers)."""

from __future__ import annotations

from heron.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_TEMPERATURE, REPETITION_PENALTY_RANGE

# choices per prompt (OpenAI's own bound)
MAX_N = 128
# prompts in one /v1/completions request (a list of strings or of token-id lists)
MAX_PROMPTS_PER_REQUEST = 256
# stop strings per request, and characters per stop string: each is matched
# against the text after every token, and the text that could begin one is
# held back from a stream
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# bad_words per request (each of 1 to MAX_STOP_STRING_CHARS characters): each is checked against the output's end
# at every step
MAX_BAD_WORDS = 128
# tools per chat request (OpenAI's limit)
MAX_TOOLS = 128
# logprobs (completions), top_logprobs (chat) and prompt_logprobs: the engine's bound
MAX_TOP_LOGPROBS = MAX_LOGPROBS
# temperature and repetition_penalty: where the sampler's float32 arithmetic stays finite
MAX_SAMPLING_TEMPERATURE = MAX_TEMPERATURE
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = REPETITION_PENALTY_RANGE

# top_k, seed and priority: integers every JSON implementation reads exactly
# (I-JSON, RFC 7493), so the schema's bounds are exact too (FastAPI writes them as
# floats), and well inside the 64 bits the engine carries (INT64_MIN..INT64_MAX)
MAX_INT = (1 << 53) - 1
MIN_INT = -MAX_INT
assert INT64_MIN < MIN_INT and MAX_INT < INT64_MAX

DEFAULT_MAX_REQUEST_BODY_BYTES = 10 << 20
# the sum of the header names' and values' lengths (Node's and h11's default head size)
DEFAULT_MAX_HEADER_BYTES = 16 << 10
