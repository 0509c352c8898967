"""`heron chat` and `heron generate` in the terminal, on the embedded model."""

from __future__ import annotations

import io
import subprocess
import sys

from heron.entrypoints.cli import build_parser
from heron.entrypoints.terminal import run_chat


def test_chat_answers_resets_survives_a_too_long_turn_and_ends_at_eof():
    args = build_parser().parse_args(["chat", "--max-tokens", "12", "--temperature", "0", "--max-model-len", "256"])
    turns = "What is the capital of Japan?\n" + "word " * 300 + "\n/reset\nAnd of France?\n"
    out = io.StringIO()
    assert run_chat(args, io.StringIO(turns), out) == 0  # Ctrl-D: the input ends
    text = out.getvalue()
    assert "Tokyo" in text and "(error:" in text and "(history cleared)" in text
    assert text.count("\n> ") == 5  # four turns and the end, the session going on after the error


def test_generate_into_a_pipe_the_reader_closed_stops_quietly():
    """`heron generate ... | head -c 5`: a BrokenPipeError traceback."""
    generate = subprocess.Popen([sys.executable, "-m", "heron.entrypoints.cli", "--log-level", "WARNING", "generate",
                                 "Once upon a time", "--max-tokens", "64", "--temperature", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert generate.stdout is not None
    generate.stdout.read(5)
    generate.stdout.close()  # the reader leaves
    _, errors = generate.communicate(timeout=120)
    assert generate.returncode == 1 and b"Traceback" not in errors, errors.decode()


def test_a_turn_stopped_before_its_first_token_leaves_no_trace(monkeypatch):
    """Ctrl-C before the answer began kept the question and an empty answer in
    the history: the next answer could come out empty."""
    from heron.entrypoints import terminal

    stream_completion, seen = terminal.stream_completion, []

    def stopped_at_once(engine, prompt, params, out):
        if not seen:
            seen.append(prompt)
            return "", "abort"  # what a Ctrl-C before any token gives
        seen.append(prompt)
        return stream_completion(engine, prompt, params, out)

    monkeypatch.setattr(terminal, "stream_completion", stopped_at_once)
    args = build_parser().parse_args(["chat", "--max-tokens", "12", "--temperature", "0", "--max-model-len", "256"])
    out = io.StringIO()
    assert run_chat(args, io.StringIO("Tell me a long story.\nWhat is the capital of Japan?\n"), out) == 0
    assert "Tokyo" in out.getvalue()
    assert "long story" not in seen[1].text and seen[1].text.count("<|im_start|>assistant") == 1


def test_chat_into_a_pipe_the_reader_closed_stops_quietly():
    """`heron chat | head -c 5`: a BrokenPipeError traceback (only generate handled it)."""
    chat = subprocess.Popen([sys.executable, "-m", "heron.entrypoints.cli", "--log-level", "WARNING", "chat",
                             "--max-tokens", "30", "--temperature", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert chat.stdin is not None and chat.stdout is not None
    chat.stdin.write(b"Say hi\n")
    chat.stdin.flush()  # and the input stays open: the session would go on
    chat.stdout.read(5)
    chat.stdout.close()  # the reader leaves
    try:
        chat.wait(timeout=120)
    finally:
        chat.kill()
    errors = chat.stderr.read() if chat.stderr else b""
    assert chat.returncode == 1 and b"Traceback" not in errors, errors.decode()


class _StrictStdin(io.StringIO):
    """A terminal read with a strict decoder: its first line is not UTF-8."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.raised = False

    def readline(self, size: int = -1) -> str:  # type: ignore[override]
        if not self.raised:
            self.raised = True
            raise UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid continuation byte")
        return super().readline(size)


def test_a_line_that_is_not_utf8_is_refused_and_the_session_goes_on():
    """A strict decoder's UnicodeDecodeError ended the session (its history
    lost); the default decoder's surrogates reached the tokenizer, whose error
    gave a position in the rendered template and said to /reset."""
    args = build_parser().parse_args(["chat", "--max-tokens", "12", "--temperature", "0", "--max-model-len", "256"])
    for stdin in (io.StringIO("caf\udce9\nWhat is the capital of Japan?\n"),  # surrogateescape, C.UTF-8's
                  _StrictStdin("What is the capital of Japan?\n")):
        out = io.StringIO()
        assert run_chat(args, stdin, out) == 0
        text = out.getvalue()
        assert "(that line is not UTF-8 text: not sent)" in text and "Tokyo" in text and "(error:" not in text
