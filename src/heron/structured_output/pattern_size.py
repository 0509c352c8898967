"""How large a JSON schema's regular expressions grow when written out.

xgrammar turns a JSON schema's ``pattern`` into grammar rules by expanding
every bounded repetition, and its parse time grows with the square of the
expanded length: ``[a-z]{1,2000}`` takes about a second, ``[a-z]{1,12000}``
53 s on a Zen 3 core (compiling it against the vocabulary as long again), all
of it on a thread nobody can interrupt. A bound on the expanded length, checked
before xgrammar sees the schema, keeps every accepted schema to well under a
second. (A ``regex`` constraint of its own is compiled another way and costs
the same whatever its bounds.)

String length bounds (``minLength``, ``maxLength``) cost the compile against
the vocabulary time that grows with the bound up to about 256 and then stays
(about 3.7 s each on a Zen 3 core), once per distinct pair of bounds, and the
pairs add up: a schema of twenty distinct large bounds, 700 bytes, held both
compile threads for minutes and every new structured request behind them.
``check_length_bounds`` caps their sum.

The size is an upper bound computed on the pattern's text: a sequence is the
sum of its parts, an alternation the sum of its branches, a repetition
``{m,n}`` its body times ``max(m, n)``, a character class or escape one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# the largest total expanded length of a schema's patterns (about 0.3 s of parse here)
MAX_PATTERN_EXPANSION = 2000
_HUGE = 10**12  # any bound past this is just "too large"


def _objects(schema: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in a schema, at any depth (the schema's own included)."""
    if isinstance(schema, dict):
        yield schema
        for value in schema.values():
            yield from _objects(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _objects(item)


def schema_patterns(schema: Any) -> Iterator[str]:
    """Every regular expression a JSON schema carries: ``pattern`` values and
    ``patternProperties`` keys, at any depth (a property *named* "pattern"
    holds a schema, not a string, and is not one)."""
    for node in _objects(schema):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from (name for name in node["patternProperties"] if isinstance(name, str))


class _Group:
    """One open group while scanning: the finished branches' total, the
    current branch's total, and the size of the branch's last atom (what a
    quantifier that follows multiplies)."""

    __slots__ = ("branches", "current", "last")

    def __init__(self) -> None:
        self.branches = 0
        self.current = 0
        self.last = 0

    def add(self, size: int) -> None:
        self.current += size
        self.last = size

    def repeat(self, times: int) -> None:
        self.current += self.last * (times - 1)
        self.last *= times

    def total(self) -> int:
        return self.branches + self.current


def _class_end(pattern: str, start: int) -> int:
    """The index after the ``]`` closing the character class opened at ``start``."""
    index = start + 1
    if index < len(pattern) and pattern[index] == "^":
        index += 1
    if index < len(pattern) and pattern[index] == "]":  # a leading ] is a literal
        index += 1
    while index < len(pattern) and pattern[index] != "]":
        index += 2 if pattern[index] == "\\" else 1
    return index + 1


def _bound(pattern: str, start: int) -> tuple[int, int] | None:
    """``(times, end)`` for a ``{m}``, ``{m,}`` or ``{m,n}`` at ``start``, or None
    when the brace is a literal."""
    close = pattern.find("}", start)
    if close < 0:
        return None
    parts = pattern[start + 1 : close].split(",")
    if len(parts) > 2 or not parts[0].strip().isdigit() or not all(p.strip().isdigit() for p in parts[1:] if p.strip()):
        return None
    numbers = [part.strip() for part in parts if part.strip()]
    times = max(_HUGE if len(number) > 12 else int(number) for number in numbers)
    return max(times, 1), close + 1


def expanded_size(pattern: str) -> int:
    """An upper bound on the length of ``pattern`` with its repetitions written out."""
    stack = [_Group()]
    index = 0
    while index < len(pattern):
        char = pattern[index]
        group = stack[-1]
        if char == "\\":
            group.add(1)
            index += 2
        elif char == "[":
            group.add(1)
            index = _class_end(pattern, index)
        elif char == "(":
            stack.append(_Group())
            index += 1
            if pattern.startswith("?", index):  # (?:, (?=, (?!, (?<name>: only the group's body counts
                index = pattern.find(":", index) + 1 if pattern.startswith("?:", index) else index + 1
        elif char == ")" and len(stack) > 1:
            stack.pop()
            stack[-1].add(group.total())
            index += 1
        elif char == "|":
            group.branches += group.current
            group.current = group.last = 0
            index += 1
        elif char == "{" and (bound := _bound(pattern, index)) is not None:
            times, index = bound
            group.repeat(times)
        elif char in "*+?":
            index += 1  # loops and options add no expansion
        else:
            group.add(1)
            index += 1
        if stack[0].total() > _HUGE:
            return _HUGE
    while len(stack) > 1:  # an unclosed group: xgrammar will say so; size what was read
        inner = stack.pop()
        stack[-1].add(inner.total())
    return stack[0].total()


class PatternTooLarge(ValueError):
    """A schema whose patterns the grammar compiler would take too long over."""


def check_schema_patterns(schema: Any) -> None:
    """PatternTooLarge (a ValueError) if the schema's patterns together expand past the limit."""
    total = sum(expanded_size(pattern) for pattern in schema_patterns(schema))
    if total > MAX_PATTERN_EXPANSION:
        size = "more than 10^12" if total >= _HUGE else str(total)
        raise PatternTooLarge(
            f"the JSON schema's patterns expand to {size} characters, more than the {MAX_PATTERN_EXPANSION} "
            "the grammar compiler takes (its time grows with the square of it: a pattern of [a-z]{1,12000} "
            "takes minutes); bound long strings with maxLength instead"
        )


# a string bound past this costs no more to compile; the sum of distinct bounds' costs one schema may bring
# (about 15 s of compile here at most)
LENGTH_BOUND_COST_CAP = 256
MAX_LENGTH_BOUND_COST = 1024


def length_bounds(schema: Any) -> set[tuple[int, int]]:
    """The distinct (minLength, maxLength) pairs of a schema's strings, at any depth."""
    found: set[tuple[int, int]] = set()
    for node in _objects(schema):
        low, high = node.get("minLength"), node.get("maxLength")
        if isinstance(low, int) or isinstance(high, int):
            found.add((low if isinstance(low, int) else 0, high if isinstance(high, int) else -1))
    return found


def check_length_bounds(schema: Any) -> None:
    """PatternTooLarge if the schema's distinct string length bounds together
    would take too long to compile."""
    bounds = length_bounds(schema)
    cost = sum(min(max(low, high, 0), LENGTH_BOUND_COST_CAP) for low, high in bounds)  # a negative one costs 0
    if cost > MAX_LENGTH_BOUND_COST:
        raise PatternTooLarge(
            f"the JSON schema's {len(bounds)} distinct string length bounds (minLength, maxLength) would take "
            f"too long to compile (each costs up to {LENGTH_BOUND_COST_CAP}, together at most "
            f"{MAX_LENGTH_BOUND_COST}: this schema's cost {cost}); give fewer distinct bounds, or share one"
        )
