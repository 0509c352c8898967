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
