"""The structured-output backend interface: compile a constraint against the
model's vocabulary, follow each request's output with a matcher, and mask the
logits of the tokens that would break the constraint."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar does not allow it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative ones)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete (its stop token was accepted)."""


class StructuredOutputBackend(ABC):
    @abstractmethod
    def compile(self, kind: str, spec: str) -> Any:
        """Compile a constraint (kind: json, json_object, regex, choice, grammar)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: list[int]) -> None:
        """Mask ``logits[logit_rows[i]]`` with ``bitmask[i]``, in place."""
