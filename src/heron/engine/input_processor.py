"""From user input to ``EngineCoreRequest``: apply the chat template, tokenize,
validate against the model, and fan ``n > 1`` out into one engine request per
sample (they then share the prompt's KV blocks through the prefix cache).

Every check fails with ``InvalidRequestError`` (or ``SamplingParamError``) naming
the offending parameter, before any engine work is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from heron.config import ModelConfig
from heron.request import EngineCoreRequest
from heron.sampling_params import SamplingParamError, SamplingParams
from heron.token_bans import NO_TOKEN_LEFT, no_token_left

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """Bad user input; ``param`` names the offending field (for HTTP 400s)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None  # a prompt dict's own (vLLM's TextPrompt / TokensPrompt carry one)


# the keys of vLLM's TextPrompt / TokensPrompt heron takes; others (multi_modal_data, mm_processor_kwargs) would
# be dropped without a word: an image the model never saw
PROMPT_DICT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, priority_scheduling: bool = False) -> None:
        """``priority_scheduling``: the scheduler orders by ``priority`` (else a
        request that sets one is refused, as vLLM refuses it: it would be ignored)."""
        from heron.loader.model_config import model_eos_token_ids

        self.priority_scheduling = priority_scheduling
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(model_eos_token_ids(model_config, tokenizer))
        self.vocab_size = model_config.vocab_size
        if hasattr(tokenizer, "__len__") and len(tokenizer) > self.vocab_size:
            logger.warning("the tokenizer has %d tokens, the model's vocabulary %d: a prompt using the others is "
                           "refused", len(tokenizer), self.vocab_size)

    # ---- prompts -----------------------------------------------------------------

    def process_prompt(self, prompt: Any) -> ProcessedPrompt:
        """Accepts a string, a list of token ids, or a dict with ``prompt`` or
        ``prompt_token_ids`` (vLLM's TextPrompt / TokensPrompt)."""
        if isinstance(prompt, dict):
            return self._dict_prompt(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", "prompt")
            check_text(prompt, "prompt")
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return self._token_prompt(prompt, None)
        raise InvalidRequestError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt"
        )

    def _dict_prompt(self, prompt: dict[str, Any]) -> ProcessedPrompt:
        unknown = sorted(str(key) for key in prompt.keys() - PROMPT_DICT_KEYS)
        if unknown:
            raise InvalidRequestError(f"a prompt dict takes {', '.join(sorted(PROMPT_DICT_KEYS))}; heron does not "
                                      f"take {', '.join(unknown)} (it serves text models)", "prompt")
        if "prompt_token_ids" in prompt:
            processed = self._token_prompt(prompt["prompt_token_ids"], prompt.get("prompt"))
        elif "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise InvalidRequestError("a prompt dict's 'prompt' must be a string", "prompt")
            processed = self.process_prompt(prompt["prompt"])
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        processed.cache_salt = prompt.get("cache_salt")  # checked with every request's (make_requests)
        return processed

    def _token_prompt(self, token_ids: Any, text: str | None) -> ProcessedPrompt:
        if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise InvalidRequestError("prompt token ids must be a list of integers", "prompt")
        # checked here too, not only with every prompt in make_requests: the server reads a token prompt before it
        # makes requests of it, and an id past 64 bits was an OverflowError there
        self._check_vocab(token_ids, hint="")
        return ProcessedPrompt(text, list(token_ids))

    def _check_vocab(self, token_ids: Sequence[int], hint: str) -> None:
        """InvalidRequestError naming the prompt's token ids outside the model's vocabulary (``hint``: why)."""
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < self.vocab_size:
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            raise InvalidRequestError(
                f"the prompt has token ids out of the model's vocabulary (size {self.vocab_size}): {bad[:5]}{hint}",
                "prompt",
            )

    def process_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        text = self.render_chat(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        # The template already holds any BOS the model wants: add no special tokens.
        return ProcessedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's chat template renders it."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", "messages")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise InvalidRequestError("every message needs a 'role'", "messages")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; use the completions API or pass chat_template",
                "messages",
            )
        knows_developer = names_developer(chat_template if chat_template is not None
                                          else getattr(self.tokenizer, "chat_template", None))
        # its refusals name the content, not the template
        flattened = [as_template_role(flatten_content(m), knows_developer) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                flattened,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors raised by the template itself
            raise InvalidRequestError(f"the chat template failed: {exc}", "messages") from exc
        check_text(str(text), "messages")
        return str(text)

    # ---- requests ----------------------------------------------------------------

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """Validate and build one engine request per sample (``params.n``)."""
        num_prompt_tokens = len(prompt.token_ids)
        max_model_len = self.model_config.max_model_len
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            # "" hashed as no salt: the unsalted cache, shared
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        if priority and not self.priority_scheduling:
            raise InvalidRequestError(f"priority {priority} needs the priority scheduling policy "
                                      "(--scheduling-policy priority); this server schedules first come, first "
                                      "served", "priority")
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        # a text prompt too: a tokenizer larger than the model's vocabulary (--tokenizer from another model, a
        # fine-tune's added tokens) gave ids the embedding could not look up, and the engine core died on them
        self._check_vocab(prompt.token_ids,
                          " (the tokenizer knows more tokens than the model)" if prompt.text is not None else "")
        if num_prompt_tokens >= max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, but the model's maximum context "
                f"length is {max_model_len} tokens and at least one token must be generated",
                "prompt",
            )
        try:
            params.validate_for_vocab(self.vocab_size)
        except SamplingParamError as exc:  # the client's token ids: a 400, not a server error
            raise InvalidRequestError(str(exc), exc.param) from exc
        if params.structured_outputs is not None:
            from heron.structured_output.xgrammar_backend import validate_constraint

            try:
                validate_constraint(*params.structured_outputs.key())
            except ValueError as exc:
                raise InvalidRequestError(str(exc), "structured_outputs") from exc
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone(bad_words_token_ids=self.bad_word_token_ids(params.bad_words))
        if no_token_left(params, self.eos_token_ids, []):  # (later, the scheduler checks each next token)
            raise InvalidRequestError(NO_TOKEN_LEFT, "allowed_token_ids")
        room = max_model_len - num_prompt_tokens
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.time() if arrival_time is None else arrival_time
        requests = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                # each sample its own seed, wrapped into 64 bits (the largest seed plus one was refused)
                seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63
                child_params = params.clone(n=1, seed=seed)
            requests.append(
                EngineCoreRequest(
                    request_id=child_request_id(request_id, index) if params.n > 1 else request_id,
                    prompt_token_ids=prompt.token_ids,
                    sampling_params=child_params,
                    eos_token_ids=self.eos_token_ids,
                    max_tokens=max_tokens,
                    arrival_time=arrival,
                    priority=priority,
                    cache_salt=cache_salt,
                )
            )
        return requests

    def bad_word_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it would start the text and as it would follow a
        word (a leading space), as vLLM bans them."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences


def check_text(text: str, param: str) -> None:
    """A Python string that is not Unicode text (a lone surrogate, which JSON's
    ``\\ud800`` escapes and Python's strings allow) has no UTF-8 form for the
    tokenizer: the client's error, named, rather than the tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"the {param} is not valid Unicode text: a lone surrogate at position {exc.start}", param
        ) from exc


def names_developer(template: Any) -> bool:
    """Whether a chat template (its source, or a dict of them) knows the ``developer`` role."""
    return "developer" in str(template)


def as_template_role(message: dict[str, Any], knows_developer: bool) -> dict[str, Any]:
    """OpenAI's ``developer`` role is its ``system`` role for newer models: a template
    that does not name it (``names_developer``) gets the message as ``system``
    (SmolLM2's rendered its default system prompt and then a
    ``<|im_start|>developer`` turn the model was never trained on)."""
    if knows_developer or message.get("role") != "developer":
        return message
    return {**message, "role": "system"}


def flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts ([{"type": "text", "text": ...}]) -> a plain string,
    one part a line (as vLLM renders them)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError("only text content parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError("a text content part needs its text as a string", "messages")
            texts.append(part["text"])
        return {**message, "content": "\n".join(texts)}  # vLLM's join: "Translate:" + "Good day" ran together
    if content is None:
        return {**message, "content": ""}
    return message
