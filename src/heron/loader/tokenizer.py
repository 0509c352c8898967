"""Load the tokenizer (with chat template and special tokens) for a model.

HF directories use transformers' AutoTokenizer. GGUF files carry their vocabulary,
merges or scores, special tokens and chat template in the metadata; byte-level BPE
and SentencePiece BPE vocabularies ("gpt2" and "llama" in GGUF terms) are rebuilt
by gguf_tokenizer.py to tokenize as llama.cpp does; other GGUF vocabularies go
through transformers' conversion.
"""

from __future__ import annotations

import os
from typing import Any

from heron.config import ModelConfig
from heron.loader.gguf_tokenizer import byte_level_bpe_tokenizer, sentencepiece_bpe_tokenizer
from heron.loader.model_source import is_gguf_file


def load_tokenizer(model_config: ModelConfig) -> Any:
    """Return a transformers tokenizer (fast) for the model. (AutoTokenizer is
    imported only where it is used: it imports torch, which a GGUF's byte-level
    BPE tokenizer, built here, does not need in the API server.)"""
    source = model_config.tokenizer or model_config.model
    if os.path.isfile(source) and is_gguf_file(source):
        return load_gguf_tokenizer(source)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:  # no tokenizer files, or files transformers cannot read
        files = [name for name in _TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
        why = "it has none of " + ", ".join(_TOKENIZER_FILES) if not files else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"cannot load a tokenizer from {source} ({why}); --tokenizer names another "
                         "directory, GGUF file or Hub id to take it from") from exc


# what transformers builds a tokenizer from
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_gguf_tokenizer(path: str) -> Any:
    from heron.loader.gguf_file import open_gguf

    gguf = open_gguf(path)
    vocabulary = gguf.metadata.get("tokenizer.ggml.model")
    builders = {"gpt2": byte_level_bpe_tokenizer, "llama": sentencepiece_bpe_tokenizer}
    if vocabulary in builders:
        try:
            return builders[vocabulary](gguf.metadata)
        # the tokenizers library raises a bare Exception for a vocabulary it cannot build (a merge of tokens the
        # vocabulary lacks): a traceback and exit 1, where a tokenizer that does not load is a usage error
        except Exception as exc:
            raise ValueError(f"{path}: the GGUF's {vocabulary!r} vocabulary cannot be built "
                             f"({type(exc).__name__}: {exc})") from exc
    # other vocabularies (WordPiece, Unigram, RWKV) through transformers' conversion, where it has one
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
