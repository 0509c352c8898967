"""The tokens a request may not sample next, from its own parameters: the rule
the worker's sampling metadata applies (``worker/sampling_metadata.py``) and the
one the input processor and the scheduler check ``allowed_token_ids`` against,
so a request whose restrictions leave no token is refused or ended with a
reason instead of sampling from a row of -inf (it emitted token 0, outside its
own ``allowed_token_ids``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from heron.sampling_params import SamplingParams

NO_TOKEN_LEFT = ("no token is left that the request's allowed_token_ids allow once its bad_words and min_tokens "
                 "(which holds back the end-of-sequence and stop_token_ids) are applied")


def banned_next_tokens(params: SamplingParams, eos_token_ids: Collection[int], num_output_tokens: int,
                       output_token_ids: Callable[[], Sequence[int]]) -> set[int]:
    """EOS (unless ignored) and the stop ids until the output has ``min_tokens``,
    except with a grammar (it decides where its output ends: once complete it
    allows only EOS, and a ban would leave no token); and each bad word's last
    token where the output ends in the rest of it (a one-token word: always).
    ``output_token_ids`` is asked only where a bad word of several tokens needs it."""
    banned: set[int] = set()
    if num_output_tokens < params.min_tokens and params.structured_outputs is None:
        banned.update(params.stop_token_ids or [])
        if not params.ignore_eos:
            banned.update(eos_token_ids)
    output: Sequence[int] | None = None
    for word in params.bad_words_token_ids or []:
        head = word[:-1]
        if head and output is None:
            output = output_token_ids()
        if not head or (output is not None and list(output[len(output) - len(head):]) == head):
            banned.add(word[-1])
    return banned


def no_token_left(params: SamplingParams, eos_token_ids: Collection[int], output_token_ids: Sequence[int]) -> bool:
    """Whether every token ``allowed_token_ids`` allows is banned next (a request
    without them always has one left)."""
    allowed = params.allowed_token_ids
    return allowed is not None and set(allowed) <= banned_next_tokens(params, eos_token_ids, len(output_token_ids),
                                                                      lambda: output_token_ids)
