"""A request's block hashes, computed in the router exactly as a replica will
(the same chat template, tokenizer and hash chain), so they can be looked up
in the replicas' KV indexes. A request the router cannot read gets no hashes:
it is routed by load alone and the replica reports what is wrong with it.
"""

from __future__ import annotations

import logging
from typing import Any

from heron.core.hashing import BlockHash, extend_block_hashes, prompt_block_hashes
from heron.engine.args import EngineArgs
from heron.engine.input_processor import InputProcessor
from heron.loader.segment_encoder import SegmentEncoder
from heron.loader.tokenizer import load_tokenizer
from heron.router.chat_render import DirectChatRenderer

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"


class PromptHasher:
    def __init__(self, model: str | None, tokenizer: str | None = None) -> None:
        """The replicas' model (an HF directory or GGUF file; default the embedded
        one), for its tokenizer and chat template."""
        config = EngineArgs(model=model, tokenizer=tokenizer, device="cpu").create_engine_config()
        self.processor = InputProcessor(config.model, load_tokenizer(config.model))
        # the Rust tokenizer behind transformers' wrapper: the same ids at a tenth of the
        # cost (the wrapper's per-call overhead is most of a short prompt's encoding)
        self._backend = getattr(self.processor.tokenizer, "_tokenizer", None)
        self._segments = SegmentEncoder.create(self._backend)
        # shared beginnings (a system prompt, a conversation so far) encoded and hashed once
        self._memo = PrefixHashMemo(self._segments) if self._segments is not None else None
        self._chat = DirectChatRenderer.create(self.processor)

    def block_hashes(self, path: str, body: dict[str, Any], block_size: int) -> list[BlockHash]:
        cache_salt = body.get("cache_salt")
        try:
            prompt = self._prompt(path, body)
            if isinstance(prompt, list):
                return prompt_block_hashes(prompt, block_size, cache_salt)
            text, add_special_tokens = prompt
            if self._memo is not None and not self._memo.encoder.encodes_whole(add_special_tokens):
                return self._memo.block_hashes(text, block_size, cache_salt if isinstance(cache_salt, str) else None)
            return prompt_block_hashes(self._encode(text, add_special_tokens), block_size, cache_salt)
        except Exception as exc:  # noqa: BLE001 (the replica will answer with the precise error)
            logger.debug("no block hashes for a request: %s", exc)
            return []

    def _prompt(self, path: str, body: dict[str, Any]) -> tuple[str, bool] | list[int]:
        """The prompt as (text, add_special_tokens), or as token ids."""
        if path == CHAT_PATH:
            if body.get("chat_template") is not None:
                # a client's template is code: the router never runs it (the replica
                # decides whether it trusts it); such a request is placed by load alone
                return []
            add_generation_prompt = body.get("add_generation_prompt", True)
            continue_final_message = body.get("continue_final_message", False)
            text = None
            if self._chat is not None and not continue_final_message and body.get("chat_template_kwargs") is None:
                text = self._chat.render(body["messages"], bool(add_generation_prompt))
            if text is None:
                text = self.processor.render_chat(
                    body["messages"],
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=body.get("chat_template_kwargs"),
                )
            return text, False
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: place it by the first
        if isinstance(prompt, str):
            return prompt, True
        return self.processor.process_prompt(prompt).token_ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._segments is not None:
            return self._segments.encode(text, add_special_tokens)
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.processor.tokenizer.encode(text, add_special_tokens=add_special_tokens))


class _Piece:
    """A node of ``PrefixHashMemo``: one piece of text after its parent's, with
    that piece's token ids and the block hashes completed by them."""

    __slots__ = ("children", "hashes", "ids")

    def __init__(self, ids: list[int], hashes: list[BlockHash]) -> None:
        self.children: dict[str, _Piece] = {}
        self.ids = ids
        self.hashes = hashes


class PrefixHashMemo:
    """Block hashes of texts, remembered along the texts' shared beginnings.

    A text is its encoder's pieces (added tokens and the text between them,
    each encoded on its own), so the pieces a request shares with an earlier
    one (a system prompt, a conversation's earlier turns) have the same ids and
    complete the same blocks: a tree of pieces, per block size and cache salt,
    keeps each piece's ids and the hashes it completed, and only the pieces
    after the first new one are encoded and hashed. Bounded by the token ids it
    holds: past ``max_tokens`` it starts over (a workload's shared beginnings
    come back at once)."""

    def __init__(self, encoder: SegmentEncoder, max_tokens: int = 1 << 20) -> None:
        self.encoder = encoder
        self.max_tokens = max_tokens
        self._roots: dict[tuple[int, str | None], _Piece] = {}
        self._tokens = 0

    def block_hashes(self, text: str, block_size: int, cache_salt: str | None) -> list[BlockHash]:
        """``prompt_block_hashes(encoder.encode(text), block_size, cache_salt)``."""
        if self._tokens > self.max_tokens:
            self._roots.clear()
            self._tokens = 0
        node = self._roots.setdefault((block_size, cache_salt), _Piece([], []))
        ids: list[int] = []
        hashes: list[BlockHash] = []
        for piece in self.encoder.pieces(text):
            child = node.children.get(piece)
            if child is None:
                piece_ids = self.encoder.piece_ids(piece)
                ids.extend(piece_ids)
                done = len(hashes)
                extend_block_hashes(hashes, ids, block_size, cache_salt)
                child = node.children[piece] = _Piece(piece_ids, hashes[done:])
                self._tokens += len(piece_ids)
            else:
                ids.extend(child.ids)
                hashes.extend(child.hashes)
            node = child
        return hashes
