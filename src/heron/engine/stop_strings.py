"""Stop strings, matched on text: the output is cut before the first match (or
after it, with ``include_stop_str_in_output``), and while streaming, the end of
the text that could begin a stop string is held back, so that a stop string
arriving across several tokens never leaks into a streamed chunk. Only that
end is held (it was always the last ``max(len(stop)) - 1`` characters: under
a stop of 256 characters, every chunk came 255 characters late)."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        longest = max((len(s) for s in self.stops), default=0)
        self.holdback = 0 if include_in_output or not self.stops else longest - 1  # the most ever held

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` to hold back: its longest
        end that is the beginning of a stop string (never a whole one: that is
        matched)."""
        if not self.holdback:
            return 0
        tail = text[-self.holdback:]
        held = 0
        for stop in self.stops:
            start = tail.find(stop[0], len(tail) - min(len(stop) - 1, len(tail)))
            while start != -1 and len(tail) - start > held:
                if stop.startswith(tail[start:]):
                    held = len(tail) - start
                    break
                start = tail.find(stop[0], start + 1)
        return held

    def find(self, text: str, num_new_chars: int) -> tuple[str, int] | None:
        """Look for a stop string that ends within the last ``num_new_chars``
        characters; return (stop string, length the text must be cut to)."""
        if not self.stops or num_new_chars <= 0:
            return None
        best: tuple[int, str] | None = None
        for stop in self.stops:
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        return stop, index + len(stop) if self.include_in_output else index
