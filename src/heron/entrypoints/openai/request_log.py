"""``heron serve --log-requests``: each request's prompt and sampling
parameters when it starts, and each output's text when it finishes, at INFO.

Without the flag nothing of a request's content reaches the logs: no other
heron logger writes prompts, messages or outputs, and API keys are never
logged at all (``tests/e2e/test_request_logging.py`` checks both, with
``--log-level DEBUG``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from heron.engine.input_processor import ProcessedPrompt
from heron.outputs import RequestOutput
from heron.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def log_prompt(request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> None:
    """The prompt as the engine gets it (a chat's messages through the template)."""
    shown = prompt.text if prompt.text is not None else prompt.token_ids
    logger.info("request %s: prompt %r (%d tokens), %s", request_id, shown, len(prompt.token_ids), params)


async def logging_outputs(
    request_id: str, stream: AsyncIterator[RequestOutput], kind: RequestOutputKind
) -> AsyncIterator[RequestOutput]:
    """``stream``, passed on unchanged, logging each completion's whole text
    when it finishes (or that the request ended before it did). Closing this
    stream closes ``stream`` (which aborts the request)."""
    texts: dict[int, str] = {}
    finished: set[int] = set()
    try:
        async for output in stream:
            for completion in output.outputs:
                before = texts.get(completion.index, "") if kind is RequestOutputKind.DELTA else ""
                texts[completion.index] = before + completion.text
                if completion.finish_reason is not None and completion.index not in finished:
                    finished.add(completion.index)
                    logger.info("request %s: output %d finished (%s): %r", request_id, completion.index,
                                completion.finish_reason, texts[completion.index])
            yield output
    finally:
        unfinished = sorted(set(texts) - finished)
        if unfinished or not texts:
            logger.info("request %s: ended before finishing (outputs so far: %r)", request_id,
                        {index: texts[index] for index in unfinished})
        await stream.aclose()  # type: ignore[attr-defined]
