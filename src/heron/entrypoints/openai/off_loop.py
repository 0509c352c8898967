"""Preparing a large prompt (the chat template's rendering, tokenization) off
the event loop.

Tokenizing costs about 1.3 us a character here: a 9 MiB prompt, within the
default body limit and refused only once counted, held the event loop 17 s,
so every stream froze and /health stopped answering (a load balancer would
take the server out). A body of ``OFF_LOOP_BODY_BYTES`` or more (or of no
declared length) is prepared on a worker thread, which the tokenizer's Rust
core runs without the GIL; a small one inline, where a thread's hop would cost
more than the work. The tokenizer is only read there (encode, never its
settings), which its Rust core allows from several threads at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")

OFF_LOOP_BODY_BYTES = 16384  # about 20 ms of tokenizing on the loop at most


async def prepare(raw_request: Request, work: Callable[[], T]) -> T:
    """``work()`` on a worker thread when the request's body is large, else here."""
    declared = raw_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) < OFF_LOOP_BODY_BYTES:
        return work()
    return await asyncio.to_thread(work)
