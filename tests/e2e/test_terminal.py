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
