"""The xgrammar backend: JSON schemas, any-JSON, regular expressions, choices and
EBNF grammars, compiled against the model's tokenizer vocabulary."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from heron.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from heron.structured_output.pattern_size import PatternTooLarge, check_length_bounds, check_schema_patterns
from heron.structured_output.schema_support import UnenforcedSchema, check_schema_support, grammar_schema


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise RuntimeError("structured output needs xgrammar: pip install xgrammar") from exc
    return xgrammar


def choice_regex(choices: list[str]) -> str:
    """A regular expression matching exactly one of the literal choices."""
    import re

    return "(" + "|".join(re.escape(choice) for choice in choices) + ")"


# The longest run of whitespace JSON may carry between two tokens.
MAX_JSON_WHITESPACE = 4
_ANY_OBJECT = '{"type": "object"}'


def _json_options(kind: str) -> dict[str, Any]:
    compact = kind.endswith("-compact")
    return {"any_whitespace": not compact, "max_whitespace_cnt": None if compact else MAX_JSON_WHITESPACE}


@functools.lru_cache(maxsize=256)
def validate_constraint(kind: str, spec: str) -> None:
    """Parse the constraint without a tokenizer; raise ValueError with xgrammar's
    explanation if it is malformed. Used before a request is accepted; usually
    cheap, but seconds for large repetition bounds (``[a-z]{1,12000}``), so the
    server runs it on a worker thread first (``check_constraints``) and a
    constraint that passed costs nothing the next time (failures are not kept)."""
    xgr = _xgrammar()
    try:
        if kind.split("-")[0] == "json":
            schema = json.loads(spec)
            check_schema_patterns(schema)
            check_length_bounds(schema)
            check_schema_support(schema)
            xgr.Grammar.from_json_schema(_grammar_spec(spec), **_json_options(kind))
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_regex(choice_regex(json.loads(spec)))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
    except (PatternTooLarge, UnenforcedSchema):
        raise
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
        raise ValueError(f"invalid {kind} constraint: {str(exc).strip().splitlines()[0]}") from exc


def _grammar_spec(spec: str) -> str:
    """The JSON schema text xgrammar compiles (``grammar_schema``): ``spec`` itself unless that changes it."""
    schema = json.loads(spec)
    adjusted = grammar_schema(schema)
    return spec if adjusted is schema else json.dumps(adjusted)


# bytes JSON never holds raw (strings escape them; whitespace between tokens is only tab, LF, CR)
_JSON_FORBIDDEN_BYTES = frozenset(range(0x20)) - {0x09, 0x0A, 0x0D}


@dataclass(frozen=True)
class _CompiledConstraint:
    """A compiled grammar, and whether its output is JSON (masked further: ``json_text_tokens``)."""

    grammar: Any
    is_json: bool


class _XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any, also_allowed: torch.Tensor | None = None) -> None:
        """``also_allowed``: a bitmask row the grammar's rows are narrowed by."""
        self._matcher = matcher
        self._also_allowed = also_allowed

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._also_allowed is not None:
            bitmask[row] &= self._also_allowed

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # no cache of xgrammar's own: its default has no bound (1.8 MB a schema on a 49k vocabulary, without
        # end), and the manager keeps the compiled grammars it reuses in a bounded LRU
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self._json_text_tokens = self._without_tokens(info, _JSON_FORBIDDEN_BYTES)

    def _without_tokens(self, info: Any, forbidden: frozenset[int]) -> torch.Tensor:
        """A bitmask row allowing every token but those whose bytes hold one of ``forbidden``.
        JSON output is narrowed by it: xgrammar's string of a schema with minLength or maxLength
        admits raw control characters, which JSON forbids (xgrammar issue 800), and the answer
        then failed to parse."""
        words = [0xFFFFFFFF] * self.allocate_bitmask(1).shape[1]
        for token_id, token in enumerate(info.decoded_vocab[:self.vocab_size]):
            if not forbidden.isdisjoint(token):
                words[token_id >> 5] &= ~(1 << (token_id & 31)) & 0xFFFFFFFF
        return torch.tensor(words, dtype=torch.int64).to(torch.int32)  # bit 31 wraps to the sign, as xgrammar's

    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar; ValueError when no output can satisfy it (``root
        ::= root``): its first step would allow no token, EOS included, and the
        request failed only after its prefill, with an error logged."""
        compiled = _CompiledConstraint(self._compile(kind, spec), kind.split("-")[0] in ("json", "json_object"))
        bitmask = self.allocate_bitmask(1)
        self.matcher(compiled).fill_bitmask(bitmask, 0)
        if not bitmask.any():
            raise ValueError(f"the {kind} constraint allows no output at all (no derivation ends)")
        return compiled

    def _compile(self, kind: str, spec: str) -> Any:
        base = kind.split("-")[0]
        if base == "json":
            return self._compiler.compile_json_schema(_grammar_spec(spec), **_json_options(kind))
        if base == "json_object":  # any object, any keys
            return self._compiler.compile_json_schema(_ANY_OBJECT, strict_mode=False, **_json_options(kind))
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        if kind == "choice":
            return self._compiler.compile_regex(choice_regex(json.loads(spec)))
        if kind == "grammar":
            return self._compiler.compile_grammar(spec)
        raise ValueError(f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        assert isinstance(compiled, _CompiledConstraint)  # what compile returns
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled.grammar),
                                self._json_text_tokens if compiled.is_json else None)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: list[int]) -> None:
        # xgrammar indexes logits and bitmask with the same row numbers: spread
        # the rows out to the logits' layout (unlisted rows stay unmasked)
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=bitmask.dtype)
        full[logit_rows] = bitmask
        self._xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), indices=logit_rows)
