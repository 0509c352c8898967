"""Tokenizers rebuilt from a GGUF file's vocabulary metadata with the ``tokenizers``
library (a fraction of a second and no torch import, where transformers' GGUF
conversion takes about 5 s), tokenizing as llama.cpp does for the same file:

- byte-level BPE (``tokenizer.ggml.model`` "gpt2": SmolLM, Llama 3, Qwen, DeepSeek):
  the text is split by the patterns ``tokenizer.ggml.pre`` names (llama.cpp's names
  for them), each piece's bytes mapped to GPT-2's alphabet, then merged;
- SentencePiece BPE ("llama": Llama 2, Mistral, TinyLlama, Phi-3): spaces become
  "▁", every stretch of text between special tokens starts with one more "▁"
  (``tokenizer.ggml.add_space_prefix``, on unless the file says otherwise, as in
  SentencePiece itself), pieces merge in the order of the merged piece's score, and
  a character outside the vocabulary becomes its UTF-8 bytes' <0xXX> tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

# The split patterns, as llama.cpp's llama-vocab.cpp and the models' own tokenizer.json define them.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5 keeps combining marks with their letters
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_RUN = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's cased letters, range by range, as its tokenizer.json lists them
_DEEPSEEK_LLM_LETTERS = (
    r"\s?[A-Za-z"
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCTUATION = r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"

# the names llama.cpp gives each pre-tokenizer: a GGUF converted from DeepSeek-R1-Distill-Qwen says
# "deepseek-r1-qwen", not "qwen2"
LLAMA3_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                         "jina-v5-nano", "dbrx", "smaug-bpe"})
_QWEN2_PRES = frozenset({"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                         "solar-open"})
# these split every digit apart before GPT-2's pattern
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "minerva", "minerva-7b",
                               "exaone"})
_GPT2_PRES = frozenset({"default", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                        "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"})
SPLITS_BY_PRE: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(_GPT2_PRES, (_GPT2_SPLIT,)),
    **dict.fromkeys(_DIGIT_SPLIT_PRES, (r"\p{N}", _GPT2_SPLIT)),
    **dict.fromkeys(LLAMA3_PRES, (_LLAMA3_SPLIT,)),
    **dict.fromkeys(_QWEN2_PRES, (_QWEN2_SPLIT,)),
    "qwen35": (_QWEN35_SPLIT,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, "[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUN, r"\p{N}"),
    "deepseek-llm": (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCTUATION, r"\s+$", _CJK_RUN, r"\p{N}+"),
}

# GGUF token types
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_BYTE = 6
_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def byte_level_bpe_tokenizer(meta: dict[str, Any]) -> Any:
    """A "gpt2" GGUF vocabulary: split, map bytes to GPT-2's alphabet, merge."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    # Llama 3's vocabulary takes a word it holds whole before its merges (as its tokenizer.json and llama.cpp do):
    # without it, words the merges do not reach split apart
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in LLAMA3_PRES))
    splits = SPLITS_BY_PRE.get(pre)
    if splits is None:
        logger.warning("GGUF pre-tokenizer %r is not one heron knows: splitting text as GPT-2 does, which may "
                       "tokenize differently from the model's own tokenizer", pre)
        splits = (_GPT2_SPLIT,)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    # llama.cpp adds BOS for Llama 3 vocabularies whose file does not say (older conversions)
    return _with_special_tokens(backend, meta, add_bos_by_default=pre in LLAMA3_PRES)


def sentencepiece_bpe_tokenizer(meta: dict[str, Any]) -> Any:
    """A "llama" GGUF vocabulary (SentencePiece BPE with scores and byte fallback)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores: Sequence[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    token_types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, token_types, vocab),
                                   unk_token=_token_at(meta, "tokenizer.ggml.unknown_token_id"), fuse_unk=True,
                                   byte_fallback=True))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[Any] = []
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", False):
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if add_space_prefix:
        # normalizers run on each stretch of text between added tokens, as llama.cpp adds the
        # space after every special token
        steps.append(normalizers.Prepend(_SPACE))
    steps.append(normalizers.Replace(" ", _SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return _with_special_tokens(backend, meta, add_bos_by_default=True)


def _merges_by_score(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int],
                     vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a vocabulary piece into two vocabulary pieces, best merged
    score first: BPE then applies, among adjacent pairs, the one whose merged piece
    scores highest, which is SentencePiece's (and llama.cpp's) rule."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, piece in enumerate(tokens):
        if len(piece) < 2 or token_types[index] in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_BYTE):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[index]), index, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _token_at(meta: dict[str, Any], key: str) -> str | None:
    """The token whose id the metadata ``key`` holds, if it names one."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    index = meta.get(key)
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _with_special_tokens(backend: Any, meta: dict[str, Any], add_bos_by_default: bool) -> Any:
    """The transformers tokenizer over ``backend``: control tokens special, user-defined
    ones added text, BOS / EOS added where the file (or llama.cpp's default) says."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # user-defined tokens are added but not special: Qwen2.5's <tool_call> as special was dropped by
    # skip_special_tokens
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_USER_DEFINED])

    bos, eos = _token_at(meta, "tokenizer.ggml.bos_token_id"), _token_at(meta, "tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_by_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        first, last = (f"{bos} " if add_bos else ""), (f" {eos}" if add_eos else "")
        added = {token: meta[key] for token, key, on in ((bos, "tokenizer.ggml.bos_token_id", add_bos),
                                                         (eos, "tokenizer.ggml.eos_token_id", add_eos)) if on}
        backend.post_processor = processors.TemplateProcessing(
            single=f"{first}$A{last}", pair=f"{first}$A{last} {first}$B{last}", special_tokens=list(added.items()),
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=_token_at(meta, "tokenizer.ggml.unknown_token_id"),
        pad_token=_token_at(meta, "tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
