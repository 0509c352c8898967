"""What `heron chat` reads as one message: from a pipe, and in a real terminal (a pty)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import subprocess
import sys
import termios
import time

from heron.entrypoints.chat_input import NOT_TEXT, ChatInput


def _messages(text: str) -> list[object]:
    reader, found = ChatInput(io.StringIO(text), io.StringIO()), []
    while (message := reader.read_message()) is not None:
        found.append(message)
    return found


def test_from_a_pipe_each_line_is_a_message_and_triple_quotes_span_lines():
    text = 'one\n  \n"""first\nsecond\n  third"""\n"""inline"""\n"""\nopen at the end\n'
    assert _messages(text) == ["one", "", "first\nsecond\n  third", "inline", "open at the end"]


def test_a_block_prompts_for_its_next_lines():
    out = io.StringIO()
    reader = ChatInput(io.StringIO('"""a\nb"""\n'), out)
    assert reader.read_message() == "a\nb"
    assert out.getvalue() == "> ... "


def test_a_line_that_is_not_utf8_is_named_not_sent():
    stream = io.TextIOWrapper(io.BytesIO(b"ok\n\xff\xfe\n"), encoding="utf-8", errors="surrogateescape")
    assert _messages_from(stream) == ["ok", NOT_TEXT]
    # inside a block: the whole block is not sent (its later lines were sent one by one)
    block = io.TextIOWrapper(io.BytesIO(b'"""first\n\xff\nsecond\nthird"""\nnext\n'), encoding="utf-8",
                             errors="surrogateescape")
    assert _messages_from(block) == [NOT_TEXT, "next"]


def _messages_from(stream: io.TextIOWrapper) -> list[object]:
    reader, found = ChatInput(stream, io.StringIO()), []
    while (message := reader.read_message()) is not None:
        found.append(message)
    return found


_TERMINAL_CHILD = """
import sys
from heron.entrypoints.chat_input import ChatInput
reader = ChatInput(sys.stdin, sys.stdout)
print("interactive", reader.interactive, flush=True)
while (message := reader.read_message()) is not None:
    print("MESSAGE", repr(message), flush=True)
print("END", flush=True)
"""


def _read_until(fd: int, marker: bytes, timeout: float = 30.0, required: bool = True) -> bytes:
    """What the terminal shows until ``marker`` (past ``timeout``: an assertion, or what came)."""
    seen, deadline = b"", time.monotonic() + timeout
    while marker not in seen:
        if time.monotonic() > deadline:
            assert not required, f"no {marker!r} in {seen!r}"
            break
        if select.select([fd], [], [], 0.1)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the child closed its end
                break
    return seen


def _own_the_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is the pty (Ctrl-C reaches it)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_in_a_terminal_a_multi_line_paste_is_one_message_and_ctrl_c_gives_up_a_line():
    """Each line of a paste was sent as a turn of its own, each answered."""
    controller, terminal = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", _TERMINAL_CHILD], stdin=terminal, stdout=terminal,
                             stderr=terminal, env={**os.environ, "TERM": "xterm-256color"},
                             preexec_fn=_own_the_terminal)
    os.close(terminal)
    try:
        assert b"interactive True" in _read_until(controller, b"> ")
        # a terminal brackets a paste as readline asks: ESC[200~ ... ESC[201~
        os.write(controller, b"\x1b[200~first line\nsecond line\x1b[201~\r")
        assert b"MESSAGE 'first line\\nsecond line'" in _read_until(controller, b"line'\r\n> ", 10)
        # a paste that opens with a docstring's marks is whole too: it waited at "... " for a closing mark
        os.write(controller, b'\x1b[200~"""A module.\n\nimport os\x1b[201~\r')
        assert b"MESSAGE '\"\"\"A module.\\n\\nimport os'" in _read_until(controller, b"os'\r\n> ", 10)
        os.write(controller, b"typed\r")  # (each waits for the prompt: readline is reading)
        assert b"MESSAGE 'typed'" in _read_until(controller, b"'typed'\r\n> ", 10)
        os.write(controller, b"half a line")
        _read_until(controller, b"half a line", 10)
        # Ctrl-C a moment after, as a hand types it. One landing between readline's echo and CPython's
        # next select() waits there for the next key (CPython's loop, not heron's): then a second one.
        given_up = b""
        for _ in range(3):
            time.sleep(0.3)
            os.write(controller, b"\x03")
            given_up += _read_until(controller, b"MESSAGE ''\r\n> ", 5, required=False)
            if b"MESSAGE ''" in given_up:
                break
        assert b"Ctrl-D or /exit quits" in given_up
        os.write(controller, b"\x04")  # Ctrl-D
        _read_until(controller, b"END", 10)
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.wait()
        os.close(controller)
