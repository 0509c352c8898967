"""``heron generate`` and ``heron chat``: stream tokens to the terminal."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

from heron.engine.args import EngineArgs
from heron.engine.input_processor import InvalidRequestError, ProcessedPrompt
from heron.engine.llm_engine import LLMEngine
from heron.entrypoints.chat_input import NOT_TEXT, ChatInput
from heron.sampling_params import RequestOutputKind, SamplingParams


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        output_kind=RequestOutputKind.DELTA,
    )


def stream_completion(
    engine: LLMEngine, prompt: ProcessedPrompt, params: SamplingParams, out: TextIO
) -> tuple[str, str | None]:
    """Run one request to the end, writing text as it arrives; returns (text, finish reason)."""
    request_id = engine.next_request_id()
    engine.add_request(request_id, prompt, params)
    pieces: list[str] = []
    finish_reason = None
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                completion = output.outputs[0]
                if completion.text:
                    out.write(completion.text)
                    out.flush()
                    pieces.append(completion.text)
                finish_reason = completion.finish_reason or finish_reason
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        finish_reason = "abort"
    return "".join(pieces), finish_reason


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)  # a bad flag is named before the model loads, not after
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    processor = engine.input_processor
    try:
        if args.chat:
            prompt = processor.process_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt = processor.process_prompt(args.prompt)
        _, finish_reason = stream_completion(engine, prompt, params, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        return _reader_left()
    finally:
        engine.shutdown()  # the disk tier's writes finished, the profile written
    print(f"[finish_reason={finish_reason}]", file=sys.stderr)
    return 130 if finish_reason == "abort" else 0  # stopped by Ctrl-C, as a shell reports it


def _reader_left() -> int:
    """The reader of stdout left (``| head``): stop quietly, as a Unix filter does."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
    return 1


def run_chat(args: argparse.Namespace, input_stream: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    params = sampling_params_from_args(args)  # a bad flag is named before the model loads, not after
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    try:
        return _chat_loop(engine, params, args.system, input_stream, out)
    except BrokenPipeError:
        return _reader_left()
    finally:
        engine.shutdown()


def _chat_loop(engine: LLMEngine, params: SamplingParams, system: str | None, input_stream: TextIO,
               out: TextIO) -> int:
    history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    out.write(
        f"heron chat with {engine.config.model.served_model_name}: /reset clears the history, /exit or Ctrl-D quits,"
        ' """ starts and ends a message of several lines\n'
    )
    reader = ChatInput(input_stream, out)
    while True:
        out.write("\n")
        message = reader.read_message()
        if message is None:
            out.write("\n")
            return 0
        if message is NOT_TEXT:
            out.write("(that line is not UTF-8 text: not sent)\n")
            continue
        assert isinstance(message, str)
        if not message:
            continue
        if message in ("/exit", "/quit"):
            return 0
        if message == "/reset":
            history = history[:1] if system else []
            out.write("(history cleared)\n")
            continue
        history.append({"role": "user", "content": message})
        try:
            prompt = engine.input_processor.process_chat(history)
            engine.input_processor.make_requests("check", prompt, params)
        except InvalidRequestError as exc:
            history.pop()
            out.write(f"(error: {exc}; try /reset)\n")
            continue
        text, finish_reason = stream_completion(engine, prompt, params, out)
        out.write("\n")
        if finish_reason == "abort" and not text:  # Ctrl-C before the first token: as if not asked
            history.pop()  # (an empty assistant turn stayed, and the next answer could come out empty)
            continue
        history.append({"role": "assistant", "content": text})
