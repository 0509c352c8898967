"""GPU tests: marked ``gpu`` and skipped where no CUDA device is present. They
need nothing but torch, triton and transformers (no embedded model), so they run
on a bare GPU machine with ``PYTHONPATH=src``."""

from __future__ import annotations

import pytest
import torch


def word_tokenizer(vocab_size: int):
    """A self-contained word-level tokenizer: ids 0, 1, 2 are <unk>, <s> and </s>
    (EOS = id 2), the rest the words "w3" .. "wN". (Special tokens are matched
    inside words, so they must not be prefixes of words: "w1" would split "w13".)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


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


VOCAB = 512


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = str(tmp_path_factory.mktemp("tiny-llama-gpu"))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.05, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    word_tokenizer(VOCAB).save_pretrained(directory)
    return directory


@torch.inference_mode()
def reference_greedy(model, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
