"""A request's block hashes, computed in the router exactly as a replica will
(the same chat template, tokenizer and hash chain), so they can be looked up
in the replicas' KV indexes. A request the router cannot read gets no hashes:
it is routed by load alone and the replica reports what is wrong with it.
"""

from __future__ import annotations

import logging
from typing import Any

from heron.core.hashing import BlockHash, prompt_block_hashes
from heron.engine.args import EngineArgs
from heron.engine.input_processor import InputProcessor
from heron.loader.segment_encoder import SegmentEncoder
from heron.loader.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"


class PromptHasher:
    def __init__(self, model: str | None, tokenizer: str | None = None) -> None:
        """The replicas' model (an HF directory or GGUF file; default the embedded
        one), for its tokenizer and chat template."""
        config = EngineArgs(model=model, tokenizer=tokenizer, device="cpu").create_engine_config()
        self.processor = InputProcessor(config.model, load_tokenizer(config.model))
        # the Rust tokenizer behind transformers' wrapper: the same ids at a tenth of the
        # cost (the wrapper's per-call overhead is most of a short prompt's encoding),
        # with the long pieces it has seen (a shared system prompt) remembered
        self._backend = getattr(self.processor.tokenizer, "_tokenizer", None)
        self._segments = SegmentEncoder.create(self._backend)

    def block_hashes(self, path: str, body: dict[str, Any], block_size: int) -> list[BlockHash]:
        try:
            token_ids = self._token_ids(path, body)
        except Exception as exc:  # noqa: BLE001 (the replica will answer with the precise error)
            logger.debug("no block hashes for a request: %s", exc)
            return []
        return prompt_block_hashes(token_ids, block_size, body.get("cache_salt"))

    def _token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if path == CHAT_PATH:
            if body.get("chat_template") is not None:
                # a client's template is code: the router never runs it (the replica
                # decides whether it trusts it); such a request is placed by load alone
                return []
            text = self.processor.render_chat(
                body["messages"],
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
            return self._encode(text, add_special_tokens=False)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: place it by the first
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        return self.processor.process_prompt(prompt).token_ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._segments is not None:
            return self._segments.encode(text, add_special_tokens)
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.processor.tokenizer.encode(text, add_special_tokens=add_special_tokens))
