"""What ``heron chat`` reads as one message.

In a terminal the line is read through GNU readline: arrow keys edit it and
recall earlier ones, and a multi-line paste stays one message (readline's
bracketed paste puts the pasted newlines into the line; without it each pasted
line was sent as a turn of its own, each answered). From a pipe or a file,
each line is a message. Either way a message may span lines between two
``\"\"\"`` marks::

    > \"\"\"Summarise this:
    ... first line
    ... second line\"\"\"
"""

from __future__ import annotations

import sys
from typing import TextIO

BLOCK_MARK = '"""'
NOT_TEXT = object()  # a line that is not UTF-8 text: the caller says so and sends nothing
_GIVEN_UP = object()  # Ctrl-C at a prompt


class ChatInput:
    """Reads messages from ``stream``, prompting on ``out``.

    ``read_message`` returns the message (stripped; '' for a blank line or a
    line given up with Ctrl-C), ``NOT_TEXT`` for input that is not UTF-8, or
    None at the end of the input (Ctrl-D).
    """

    def __init__(self, stream: TextIO, out: TextIO) -> None:
        self.stream = stream
        self.out = out
        self.interactive = stream is sys.stdin and _is_tty(stream) and out is sys.stdout and _is_tty(out)
        if self.interactive:
            import readline  # noqa: F401  (input() edits and recalls lines through it once it is loaded)

    def read_message(self, prompt: str = "> ") -> str | None | object:
        first = self._read_line(prompt)
        if first is _GIVEN_UP:
            return ""
        if not isinstance(first, str):
            return first
        text = first.strip()
        if not text.startswith(BLOCK_MARK) or "\n" in text:  # a paste of several lines is whole already
            return text  # (one opening with a docstring's marks waited for a closing one)
        return self._read_block(text[len(BLOCK_MARK):])

    def _read_block(self, opening: str) -> str | None | object:
        """The lines up to the closing mark; at the end of the input, what came."""
        lines = [opening]
        while not _closes_block(lines[-1]):
            line = self._read_line("... ")
            if line is None:
                return "\n".join(lines).strip()
            if line is NOT_TEXT:
                return self._drop_block()
            if line is _GIVEN_UP:  # the whole message is given up
                return ""
            assert isinstance(line, str)
            lines.append(line.rstrip("\r\n"))
        lines[-1] = lines[-1].rstrip()[: -len(BLOCK_MARK)]
        return "\n".join(lines).strip()

    def _drop_block(self) -> object:
        """A block with a line that is not text is not sent: its lines up to the closing
        mark are read and dropped (each was sent as a turn of its own)."""
        while True:
            line = self._read_line("... ")
            if line is None or line is _GIVEN_UP or (isinstance(line, str) and _closes_block(line)):
                return NOT_TEXT

    def _read_line(self, prompt: str) -> str | None | object:
        if self.interactive:
            return self._input(prompt)
        self.out.write(prompt)
        self.out.flush()
        try:
            line = self.stream.readline()
        except UnicodeDecodeError:  # a strict decoder: it ended the session
            return NOT_TEXT
        if not line:
            return None
        return line if _is_utf8(line) else NOT_TEXT  # the lenient one let surrogates through to the tokenizer

    def _input(self, prompt: str) -> str | None | object:
        try:
            line = input(prompt)
        except EOFError:
            return None
        except UnicodeDecodeError:
            return NOT_TEXT
        except KeyboardInterrupt:  # as a shell does: the line is given up, the session goes on
            self.out.write("\n(Ctrl-D or /exit quits)\n")
            return _GIVEN_UP
        return line if _is_utf8(line) else NOT_TEXT


def _closes_block(line: str) -> bool:
    return line.rstrip().endswith(BLOCK_MARK)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (ValueError, AttributeError):  # closed, or no such method
        return False
