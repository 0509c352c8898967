"""Load the tokenizer (with chat template and special tokens) for a model.

HF directories use transformers' AutoTokenizer. GGUF files carry their vocabulary,
merges, special tokens and chat template in the metadata; byte-level BPE
vocabularies ("gpt2" in GGUF terms: SmolLM, Llama 3, Qwen) are rebuilt directly
with the ``tokenizers`` library, which takes a fraction of a second, instead of
transformers' GGUF conversion (about 5 s). Other GGUF vocabularies (SentencePiece)
go through transformers' conversion.
"""

from __future__ import annotations

import os
from typing import Any

from heron.config import ModelConfig

# Pre-tokenizer split patterns by GGUF ``tokenizer.ggml.pre`` value, as llama.cpp
# defines them; the byte-level step then maps bytes to the GPT-2 alphabet.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE: dict[str, str] = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# These vocabularies split every digit apart before the GPT-2 byte-level regex.
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "minerva"}
# GGUF token types that are special (control) or user-defined added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def load_tokenizer(model_config: ModelConfig) -> Any:
    """Return a transformers tokenizer (fast) for the model. (AutoTokenizer is
    imported only where it is used: it imports torch, which a GGUF's byte-level
    BPE tokenizer, built here, does not need in the API server.)"""
    if model_config.tokenizer or model_config.source_format == "hf":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_config.tokenizer or model_config.model)
    return load_gguf_tokenizer(model_config.model)


def load_gguf_tokenizer(path: str) -> Any:
    from heron.loader.gguf_file import open_gguf

    gguf = open_gguf(path)
    if gguf.metadata.get("tokenizer.ggml.model") == "gpt2":
        return _byte_level_bpe_tokenizer(gguf.metadata)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _byte_level_bpe_tokenizer(meta: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))

    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre in _SPLIT_BY_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()

    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    backend.add_special_tokens(special)

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    bos = token_at("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
