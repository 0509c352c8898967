"""GPU tests: marked ``gpu`` and skipped where no CUDA device is present. They
need nothing but torch, triton and transformers (no embedded model), so they run
on a bare GPU machine with ``PYTHONPATH=src``."""

from __future__ import annotations

import pytest
import torch


def word_tokenizer(vocab_size: int):
    """A self-contained word-level tokenizer ("w0" .. "wN"), EOS = id 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", bos_token="w1", eos_token="w2")


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    return torch.device("cuda")


def byte_level_tokenizer():
    """A self-contained byte-level tokenizer (one token per byte, no merges) that
    can spell any text; EOS = id 0, BOS = id 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<s>": 1}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|endoftext|>")
