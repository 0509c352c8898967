"""Load the tokenizer (with chat template and special tokens) for a model.

HF directories use transformers' AutoTokenizer. GGUF files carry their vocabulary,
merges, special tokens and chat template in the metadata; byte-level BPE
vocabularies ("gpt2" in GGUF terms: SmolLM, Llama 3, Qwen) are rebuilt directly
with the ``tokenizers`` library, which takes a fraction of a second, instead of
transformers' GGUF conversion (about 5 s). Other GGUF vocabularies (SentencePiece)
go through transformers' conversion.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from heron.config import ModelConfig

logger = logging.getLogger(__name__)

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
# the names llama.cpp gives each pre-tokenizer (its llama-vocab.cpp): a GGUF converted from DeepSeek-R1-Distill-Qwen
# says "deepseek-r1-qwen", not "qwen2", and fell back to GPT-2's split
_LLAMA3_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                          "jina-v5-nano"})
_QWEN2_PRES = frozenset({"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"})
_SPLIT_BY_PRE: dict[str, str] = {
    **dict.fromkeys(_LLAMA3_PRES, _LLAMA3_SPLIT),
    **dict.fromkeys(_QWEN2_PRES, _QWEN2_SPLIT),
}
# These vocabularies split every digit apart before the GPT-2 byte-level regex.
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "minerva", "minerva-7b"}
# GPT-2's own split, by its other names (no warning for them)
_GPT2_PRES = {"default", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "mellum",
              "modern-bert", "exaone4"}
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
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    # Llama 3's vocabulary takes a word it holds whole before its merges (as its tokenizer.json and llama.cpp do):
    # without it, words the merges do not reach split apart
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRES))
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
        if pre not in _GPT2_PRES:
            logger.warning("GGUF pre-tokenizer %r is not one heron knows: splitting text as GPT-2 does, which may "
                           "tokenize differently from the model's own tokenizer", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()

    # control tokens are special; user-defined ones are added tokens that are not (Qwen2.5's <tool_call> is one:
    # as special, skip_special_tokens dropped it from the text)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_USER_DEFINED])

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    bos = token_at("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS for Llama 3 vocabularies whose file does not say (older conversions)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRES)) and bos is not None
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
