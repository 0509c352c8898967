"""A request's block hashes, computed in the router exactly as a replica will
(the same chat template, tokenizer and hash chain), so they can be looked up
in the replicas' KV indexes. A request the router cannot read gets no hashes:
it is routed by load alone and the replica reports what is wrong with it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from heron.core.hashing import BlockHash, extend_block_hashes, prompt_block_hashes
from heron.engine.args import EngineArgs
from heron.engine.input_processor import InputProcessor
from heron.loader.segment_encoder import SegmentEncoder
from heron.loader.tokenizer import load_tokenizer
from heron.router.chat_render import DirectChatRenderer

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
# only a prompt's beginning is hashed: affinity is decided by the leading blocks, and a whole 8 MB prompt
# took 38 s to tokenize and hash (the router's loop stalled for every client meanwhile)
MAX_HASHED_CHARS = 1 << 16
MAX_HASHED_TOKENS = 1 << 14


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request as the chat request its replica renders (empty
    when the router cannot know its prompt: a follow-up, whose history only the
    replica holds, goes to that replica anyway)."""
    if body.get("previous_response_id") is not None:
        return {}
    from heron.entrypoints.openai.protocol_responses import ResponsesRequest
    from heron.entrypoints.openai.serving_responses import chat_request, input_messages

    request = ResponsesRequest.model_validate(body)
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    chat = chat_request(request, system + input_messages(request))
    return {"messages": [message.model_dump(exclude_none=True) for message in chat.messages],
            "tools": [tool.model_dump(exclude_none=True) for tool in chat.tools or []] or None}


def leading_text(text: str, max_chars: int = MAX_HASHED_CHARS) -> tuple[str, bool]:
    """(the beginning of ``text`` that is hashed, whether it was cut). A cut
    falls before a space that follows a word, where tokenizers start a new
    token (byte-level BPE and SentencePiece alike), so the tokens before it are
    the whole text's; a text with no such space within bounds is cut anyway
    (the caller also drops the last block)."""
    if len(text) <= max_chars:
        return text, False
    cut = text.rfind(" ", max_chars // 2, max_chars)
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return text[: cut if cut > 0 else max_chars], True


class PromptHasher:
    def __init__(self, model: str | None, tokenizer: str | None = None, chat_template: str | None = None) -> None:
        """The replicas' model (an HF directory or GGUF file; default the embedded
        one), for its tokenizer and chat template; ``chat_template``: the one the
        replicas were started with (their ``--chat-template``), if not the model's."""
        config = EngineArgs(model=model, tokenizer=tokenizer, device="cpu").create_engine_config()
        loaded = load_tokenizer(config.model)
        if chat_template is not None:  # this router's own tokenizer: renders as the replicas do
            loaded.chat_template = chat_template
        self.processor = InputProcessor(config.model, loaded)
        # the Rust tokenizer behind transformers' wrapper: the same ids at a tenth of the
        # cost (the wrapper's per-call overhead is most of a short prompt's encoding)
        self._backend = getattr(self.processor.tokenizer, "_tokenizer", None)
        self._segments = SegmentEncoder.create(self._backend)
        # shared beginnings (a system prompt, a conversation so far) encoded and hashed once
        self._memo = PrefixHashMemo(self._segments) if self._segments is not None else None
        self._chat = DirectChatRenderer.create(self.processor)
        self._lock = threading.Lock()

    def block_hashes(self, path: str, body: dict[str, Any], block_size: int) -> list[BlockHash]:
        """The hashes of the prompt's leading blocks (at most ``MAX_HASHED_CHARS``
        of its text, ``MAX_HASHED_TOKENS`` of its ids). One caller at a time
        (the memo and caches are shared): the router calls it on the event loop
        for small bodies and on one worker thread for large ones."""
        with self._lock:
            return self._block_hashes(path, body, block_size)

    def _block_hashes(self, path: str, body: dict[str, Any], block_size: int) -> list[BlockHash]:
        cache_salt = body.get("cache_salt")
        try:
            prompt = self._prompt(path, body)
            if isinstance(prompt, list):
                return prompt_block_hashes(prompt[:MAX_HASHED_TOKENS], block_size, cache_salt)
            text, cut = leading_text(prompt[0])
            add_special_tokens = prompt[1]
            if self._memo is not None and not self._memo.encoder.encodes_whole(add_special_tokens):
                salt = cache_salt if isinstance(cache_salt, str) else None
                hashes = self._memo.block_hashes(text, block_size, salt)
            else:
                hashes = prompt_block_hashes(self._encode(text, add_special_tokens), block_size, cache_salt)
            return hashes[:-1] if cut else hashes  # the block at the cut may differ from the whole text's
        except Exception as exc:  # noqa: BLE001 (the replica will answer with the precise error)
            logger.debug("no block hashes for a request: %s", exc)
            return []

    def _prompt(self, path: str, body: dict[str, Any]) -> tuple[str, bool] | list[int]:
        """The prompt as (text, add_special_tokens), or as token ids."""
        if path == RESPONSES_PATH:
            body = responses_as_chat(body)
            if not body:
                return []
            path = CHAT_PATH
        if path == CHAT_PATH:
            if body.get("chat_template") is not None:
                # a client's template is code: the router never runs it (the replica
                # decides whether it trusts it); such a request is placed by load alone
                return []
            return self._render_chat(body), False
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: place it by the first
        if isinstance(prompt, str):
            # as the replica encodes it: a client's add_special_tokens false leaves out the BOS a tokenizer adds
            return prompt, body.get("add_special_tokens", True) is not False
        return self.processor.process_prompt(prompt).token_ids

    def _render_chat(self, body: dict[str, Any]) -> str:
        """The chat as the replica renders it: tools (and tool turns) go through
        the same ``template_messages`` (written into the system message, or the
        template's ``tools``), else the prompt's blocks never matched the replica's."""
        messages = body["messages"]
        tools = body.get("tools") or None
        template_kwargs = body.get("chat_template_kwargs")
        if tools or any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages):
            from heron.engine.tool_prompting import template_messages
            from heron.entrypoints.openai.protocol import ChatCompletionRequest

            # the replica's reading of them (defaults filled, nulls dropped), then its rewriting
            request = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})
            messages = [message.model_dump(exclude_none=True) for message in request.messages]
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []] or None
            template = getattr(self.processor.tokenizer, "chat_template", None)
            messages, tool_kwargs = template_messages(messages, tools, template)
            template_kwargs = {**(template_kwargs or {}), **tool_kwargs} or None
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final_message = body.get("continue_final_message", False)
        text = None
        if self._chat is not None and not continue_final_message and template_kwargs is None:
            text = self._chat.render(messages, bool(add_generation_prompt))
        if text is None:
            text = self.processor.render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=template_kwargs,
            )
        return text

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
