"""Structured output in the engine core: grammars compile off the step loop, a
request waits in its own state until its grammar is ready (others keep running),
compiled grammars are cached by constraint, and each step one bitmask covers
every structured request that samples.

The manager loads the tokenizer (the xgrammar vocabulary needs it) the first
time a structured request arrives, so unconstrained serving never pays for it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from heron.config import ModelConfig
from heron.request import Request
from heron.structured_output.backend import GrammarMatcher, StructuredOutputBackend

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256
_COMPILE_WORKERS = 2


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        # two at once: a grammar that takes long to compile (a schema of large string bounds: seconds) does not
        # hold up every other structured request behind it
        self._executor = ThreadPoolExecutor(max_workers=_COMPILE_WORKERS, thread_name_prefix="heron-grammar")
        self._compiled: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._pending: dict[str, Future[Any]] = {}
        self.matchers: dict[str, GrammarMatcher] = {}
        self._errors: dict[str, str] = {}  # why a request's grammar did not compile, until taken

    def _get_backend(self) -> StructuredOutputBackend:
        with self._backend_lock:  # the compile workers may ask for it together
            return self._backend_or_new()

    def _backend_or_new(self) -> StructuredOutputBackend:
        if self._backend is None:
            from heron.loader.model_config import model_eos_token_ids
            from heron.loader.tokenizer import load_tokenizer
            from heron.structured_output.xgrammar_backend import XGrammarBackend

            tokenizer = load_tokenizer(self.model_config)
            stops = model_eos_token_ids(self.model_config, tokenizer)
            self._backend = XGrammarBackend(tokenizer, self.model_config.vocab_size, stops)
        return self._backend

    def _compile(self, key: tuple[str, str]) -> Any:
        return self._get_backend().compile(*key)

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (or reuse a cached one)."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = params.key()
        future = self._compiled.get(key)
        if future is None:
            future = self._executor.submit(self._compile, key)
            self._compiled[key] = future
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        self._pending[request.request_id] = future

    def is_ready(self, request: Request) -> bool | None:
        """True once the grammar is compiled and the request has its matcher;
        False while compiling; None if compiling failed (the request must end)."""
        if request.request_id in self.matchers:
            return True
        future = self._pending.get(request.request_id)
        if future is None or not future.done():
            return False
        del self._pending[request.request_id]
        try:
            compiled = future.result()
        except Exception as exc:  # xgrammar's parse passed it; its compile, against the vocabulary, did not
            logger.warning("compiling the grammar of %s failed: %s", request.request_id, exc)
            self._errors[request.request_id] = f"the output constraint could not be compiled: {exc}"
            return None
        matcher = self._get_backend().matcher(compiled)
        # a request resumed after preemption replays the tokens it already has
        for token_id in request.output_token_ids:
            matcher.accept_token(token_id)
        self.matchers[request.request_id] = matcher
        return True

    def wait_for_compile(self, timeout: float) -> None:
        """Block (releasing the GIL) until some pending grammar is compiled or
        ``timeout`` passes: what an engine step with nothing to run does instead
        of spinning, which would starve the compiling thread."""
        pending = [future for future in self._pending.values() if not future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def take_error(self, request_id: str) -> str | None:
        """Why the request's grammar did not compile (once)."""
        return self._errors.pop(request_id, None)

    def remove_request(self, request_id: str) -> None:
        """Forget the request; a compile of its grammar not yet started that no
        other request waits on is cancelled (clients that left queued their
        grammars' compiles, seconds each, ahead of every new structured request)."""
        self.matchers.pop(request_id, None)
        self._errors.pop(request_id, None)
        future = self._pending.pop(request_id, None)
        if future is None or future.done() or any(other is future for other in self._pending.values()):
            return
        if future.cancel():
            for key, cached in self._compiled.items():
                if cached is future:
                    del self._compiled[key]  # the next request for it compiles it afresh
                    break

    def bitmask(self, request_ids: list[str], drafts: dict[str, list[int]] | None = None) -> torch.Tensor | None:
        """The tokens each request may sample next, in order: one row per
        request, plus one per draft token it verifies (row ``j`` is the mask
        after its first ``j`` drafts). The matcher walks the drafts to fill the
        rows and is rolled back, so it only ever advances on accepted tokens; a
        draft the grammar forbids leaves the rows after it unmasked (its own
        row's mask already rejects it), and so does a draft that ends the grammar."""
        if not request_ids:
            return None
        drafts = drafts or {}
        num_rows = sum(1 + len(drafts.get(request_id, ())) for request_id in request_ids)
        bitmask = self._get_backend().allocate_bitmask(num_rows)
        row = 0
        for request_id in request_ids:
            matcher = self.matchers[request_id]
            request_drafts = drafts.get(request_id, ())
            matcher.fill_bitmask(bitmask, row)
            walked = 0
            for token_id in request_drafts:
                if not matcher.accept_token(token_id):
                    break
                walked += 1
                if matcher.is_terminated():
                    # the draft ended the grammar (a stop token): nothing after it is sampled, and a finished
                    # matcher has no next mask (asking for one raised, and stopped the engine core)
                    break
                matcher.fill_bitmask(bitmask, row + walked)
            matcher.rollback(walked)
            row += 1 + len(request_drafts)  # rows after the walk stay all-allowed
        return bitmask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: list[int]) -> None:
        self._get_backend().apply_bitmask(logits, bitmask, logit_rows)

    def accept(self, request_id: str, token_id: int) -> bool:
        return self.matchers[request_id].accept_token(token_id)

    def is_terminated(self, request_id: str) -> bool:
        return self.matchers[request_id].is_terminated()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
