"""Benchmark prompts: random (token-exact lengths), ShareGPT files, and
prefix-repetition (many prompts sharing long prefixes).

Random prompts are built from whole-word vocabulary tokens ("Ġword" in byte-level
BPE, "▁word" in SentencePiece, plain words in a word-level vocabulary), which
re-tokenize to themselves, and every prompt is checked (and trimmed or padded)
until it encodes to exactly the length asked.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


class WordTokens:
    """Whole-word tokens of a tokenizer, for building prompts of exact lengths."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab: dict[str, int] = tokenizer.get_vocab()
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        words = []
        for token, token_id in vocab.items():
            if token_id in special or len(token) < 3 or token[0] not in ("Ġ", "▁"):
                continue
            body = token[1:]
            if body.isascii() and body.isalpha() and body.islower():
                words.append(token_id)
        if len(words) < 100:
            words = self._word_level_tokens(vocab, special)
        if len(words) < 100:
            raise ValueError("the tokenizer has too few whole-word tokens to build random prompts")
        self.word_ids = sorted(words)

    def _word_level_tokens(self, vocab: dict[str, int], special: set[int]) -> list[int]:
        """A word-level tokenizer's plain alphanumeric tokens (it splits on
        spaces, so a token is a word without any marker), if a sample of them
        decodes and re-encodes to itself."""
        words = [
            token_id
            for token, token_id in vocab.items()
            if token_id not in special and len(token) >= 2 and token.isascii() and token.isalnum()
        ]
        sample = sorted(words)[:: max(1, len(words) // 64)][:64]
        return words if sample and self.encode(self.tokenizer.decode(sample)) == sample else []

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text_of_length(self, length: int, rng: random.Random, prefix: str = "") -> str:
        """A text of random words that (after ``prefix``) encodes to exactly
        ``length`` tokens."""
        target = len(self.encode(prefix)) + length if prefix else length
        ids = [rng.choice(self.word_ids) for _ in range(length)]
        text = prefix + self.tokenizer.decode(ids)
        for _ in range(50):
            actual = len(self.encode(text))
            if actual == target:
                return text
            if actual > target:
                ids = ids[: len(ids) - (actual - target)]
            else:
                ids = ids + [rng.choice(self.word_ids) for _ in range(target - actual)]
            text = prefix + self.tokenizer.decode(ids)
        raise ValueError(f"could not build a prompt of exactly {length} tokens")


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_dataset(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
    prefix_len: int = 0, seed: int = 0, output_range_ratio: float | None = None,
) -> list[SampleRequest]:
    """Input and output lengths drawn uniformly from [len*(1-r), len*(1+r)]
    (``output_range_ratio`` defaults to ``range_ratio``); an optional shared prefix
    of ``prefix_len`` tokens."""
    output_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    rng = random.Random(seed)
    words = WordTokens(tokenizer)
    prefix = words.text_of_length(prefix_len, rng) if prefix_len else ""
    samples = []
    for _ in range(num_prompts):
        length = _length(rng, input_len, range_ratio)
        prompt = words.text_of_length(length, rng, prefix=prefix)
        samples.append(SampleRequest(prompt, prefix_len + length, _length(rng, output_len, output_ratio)))
    return samples


def prefix_repetition_dataset(
    tokenizer: Any,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes, each shared by ``num_prompts / num_prefixes``
    prompts that differ in a random suffix."""
    rng = random.Random(seed)
    words = WordTokens(tokenizer)
    prefixes = [words.text_of_length(prefix_len, rng) for _ in range(num_prefixes)]
    samples = []
    for index in range(num_prompts):
        prompt = words.text_of_length(suffix_len, rng, prefix=prefixes[index % num_prefixes])
        samples.append(SampleRequest(prompt, len(words.encode(prompt)), output_len))
    rng.shuffle(samples)
    return samples


def sharegpt_dataset(
    tokenizer: Any, path: str, num_prompts: int, output_len: int | None = None, seed: int = 0,
    max_prompt_len: int = 1024, max_total_len: int = 2048,
) -> list[SampleRequest]:
    """First human turn as the prompt, the first model reply's length as the
    output length (unless ``output_len`` is given: then any reply will do);
    too long or too short conversations are skipped, as vLLM does. ValueError
    naming the file when it is not ShareGPT's shape (a list of objects whose
    ``conversations`` are ``{"from", "value"}`` turns)."""
    conversations = _read_sharegpt(path)
    rng = random.Random(seed)
    rng.shuffle(conversations)
    samples = []
    for entry in conversations:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(turn, dict) for turn in turns[:2]):
            raise ValueError(f"{path}: a conversation's turns must be objects with a \"value\", got {turns[0]!r}")
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        reply_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        too_short = prompt_len < 4 or (output_len is None and reply_len < 4)
        if too_short or prompt_len > max_prompt_len or prompt_len + reply_len > max_total_len:
            continue
        samples.append(SampleRequest(prompt, prompt_len, reply_len))
        if len(samples) == num_prompts:
            break
    if len(samples) < num_prompts:
        raise ValueError(f"{path} has only {len(samples)} usable conversations, {num_prompts} asked")
    return samples


def _read_sharegpt(path: str) -> list[dict[str, Any]]:
    """The file's conversations: a JSON list of objects."""
    try:
        with open(path, encoding="utf-8") as handle:
            conversations = json.load(handle)
    except (OSError, ValueError) as exc:  # ValueError: not JSON, not UTF-8
        raise ValueError(f"cannot read the ShareGPT file {path}: {exc}") from exc
    if not isinstance(conversations, list) or not all(isinstance(entry, dict) for entry in conversations):
        raise ValueError(f"{path} is not a ShareGPT file: expected a JSON list of objects with \"conversations\"")
    return conversations
