"""Tokenizers rebuilt from GGUF metadata (loader/gguf_tokenizer.py), on small
made-up vocabularies. Byte-level BPE: the pre-tokenizer each ``tokenizer.ggml.pre``
name means (llama.cpp's names, aliases included), Llama 3's whole-word rule and
BOS default, and which added tokens are special. SentencePiece BPE: the space
prefix, merges by score, byte fallback, BOS / EOS. (Against llama.cpp's own
vocabularies and expected tokens: benchmarks/gguf_vocab_check.py.)"""

from __future__ import annotations

import logging

import pytest

from heron.loader.gguf_tokenizer import byte_level_bpe_tokenizer, sentencepiece_bpe_tokenizer

TOKENS = ["<s>", "</s>", "c", "d", "cd", "Ġ", "1", "2", "3", "12", "<tool_call>"]
TYPES = [3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 4]  # 3: control, 4: user-defined, 1: normal


def tokenizer(pre: str, **metadata):
    return byte_level_bpe_tokenizer({
        "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.token_type": TYPES, "tokenizer.ggml.merges": ["1 2"],
        "tokenizer.ggml.pre": pre, "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, **metadata,
    })


def split(pre: str, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer(pre).backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("alias, name", [("deepseek-r1-qwen", "qwen2"), ("megrez", "qwen2"),
                                         ("llama-v3", "llama3"), ("falcon3", "llama3"), ("pixtral", "llama-bpe")])
def test_llama_cpps_aliases_split_as_their_pre_tokenizer(alias, name):
    # they fell back to GPT-2's split: DeepSeek-R1-Distill-Qwen's GGUFs tokenized numbers and symbols differently
    text = "ied 4 ½ months 12345 don't"
    assert split(alias, text) == split(name, text) != split("default", text)


def test_llama3_takes_a_word_it_holds_whole_before_its_merges():
    assert tokenizer("llama3").encode("cd", add_special_tokens=False) == [4]  # "cd" is in the vocabulary
    assert tokenizer("default").encode("cd", add_special_tokens=False) == [2, 3]  # no merge reaches it
    assert tokenizer("llama3").encode("12", add_special_tokens=False) == [9]


def test_llama3_adds_bos_unless_the_file_says_otherwise():
    assert tokenizer("llama3").encode("c") == [0, 2]  # older conversions have no add_bos_token key
    assert tokenizer("llama3", **{"tokenizer.ggml.add_bos_token": False}).encode("c") == [2]
    assert tokenizer("qwen2").encode("c") == [2]


def test_user_defined_tokens_are_added_but_not_special():
    # a user-defined token (Qwen2.5's <tool_call>) is text: skip_special_tokens used to drop it
    tok = tokenizer("qwen2")
    ids = tok.encode("c<tool_call>d", add_special_tokens=False)
    assert ids == [2, 10, 3]
    assert tok.decode(ids, skip_special_tokens=True) == "c<tool_call>d"
    assert tok.decode([0, 2], skip_special_tokens=True) == "c"  # control tokens stay special


def test_an_unknown_pre_tokenizer_is_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="heron.loader.tokenizer"):
        tokenizer("some-new-model")
        tokenizer("gpt-2")
    assert [record.getMessage().count("some-new-model") for record in caplog.records] == [1]


@pytest.mark.parametrize("pre, text, pieces", [
    # these fell back to GPT-2's split: Falcon cuts digit runs in threes, DeepSeek Coder splits digits apart,
    # Qwen 3.5 keeps a combining mark with its letter
    ("falcon", "3333", ["333", "3"]),
    ("falcon", "a+=b", ["a", "+=", "b"]),
    ("deepseek-coder", "x 123", ["x", " ", "1", "2", "3"]),
    ("deepseek-llm", "ab 12\ncd", ["ab", " ", "12", "\n", "cd"]),
    ("qwen35", "e\u0301t", ["e\u0301t"]),
])
def test_llama_cpps_other_pre_tokenizers_split_as_llama_cpp_does(pre, text, pieces):
    byte_level = [tokenizer(pre).backend_tokenizer.pre_tokenizer.pre_tokenize_str(piece)[0][0] for piece in pieces]
    assert split(pre, text) == byte_level


def test_gpt2_pattern_names_need_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="heron.loader.gguf_tokenizer"):
        for pre in ("mpt", "olmo", "default"):
            tokenizer(pre)
    assert not caplog.records


# every piece is reachable by merges of two pieces, as in a trained vocabulary
SPM_TOKENS = ["<unk>", "<s>", "</s>", "<0x0A>", "<0xC3>", "<0xA9>", "\u2581", "\u2581\u2581", "H", "e", "l", "o",
              "w", "r", "d", "He", "ll", "lo", "Hell", "Hello", "\u2581Hello", "\u2581w", "or", "ld", "orld",
              "\u2581world", "<tool>"]
SPM_TYPES = [2, 3, 3, 6, 6, 6] + [1] * 20 + [4]  # 2: unknown, 3: control, 6: byte, 1: normal, 4: user-defined
HELLO = SPM_TOKENS.index("\u2581Hello")


def spm_tokenizer(scores: dict[str, float] | None = None, **metadata):
    score_of = {"\u2581Hello": -1.0, "\u2581world": -2.0, "Hello": -3.0, "Hell": -4.0, "orld": -5.0, "He": -6.0,
                "ll": -7.0, "lo": -8.0, "\u2581w": -9.0, "or": -10.0, "ld": -11.0, "\u2581\u2581": -30.0,
                **(scores or {})}
    return sentencepiece_bpe_tokenizer({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": SPM_TOKENS, "tokenizer.ggml.token_type": SPM_TYPES,
        "tokenizer.ggml.scores": [score_of.get(token, -50.0) for token in SPM_TOKENS],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
        **metadata,
    })


def pieces(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))


def test_sentencepiece_text_starts_with_a_space_as_llama_cpp_does():
    tok = spm_tokenizer()
    assert pieces(tok, "Hello world") == ["\u2581Hello", "\u2581world"]
    # transformers' conversion dropped the space a text already starts with: [▁Hello] for " Hello"
    assert pieces(tok, " Hello") == ["\u2581", "\u2581Hello"]
    assert pieces(tok, "  ") == ["\u2581\u2581", "\u2581"]
    # after a special token too (llama.cpp adds it after every one)
    assert pieces(tok, "<s>Hello") == ["<s>", "\u2581Hello"]
    assert pieces(tok, "Hello<tool>world") == ["\u2581Hello", "<tool>", "\u2581world"]
    assert pieces(spm_tokenizer(**{"tokenizer.ggml.add_space_prefix": False}), "Hello world") == [
        "Hello", "\u2581world"]
    extra = spm_tokenizer(**{"tokenizer.ggml.remove_extra_whitespaces": True})
    assert pieces(extra, "  Hello   world ") == ["\u2581Hello", "\u2581world"]


def test_sentencepiece_merges_the_best_scoring_pair_first():
    # "llo": the pairs make "ll" and "lo"; the better score wins, whatever the token ids' order
    no_prefix = {"tokenizer.ggml.add_space_prefix": False}
    assert pieces(spm_tokenizer({"ll": -7.0, "lo": -8.0}, **no_prefix), "llo") == ["ll", "o"]
    assert pieces(spm_tokenizer({"ll": -8.0, "lo": -7.0}, **no_prefix), "llo") == ["l", "lo"]


def test_sentencepiece_falls_back_to_bytes_and_decodes_back():
    tok = spm_tokenizer()
    assert pieces(tok, "\u00e9") == ["\u2581", "<0xC3>", "<0xA9>"]
    for text in (" Hello world\n", "Hello\u00e9 world", "  ow", "Hello\nworld"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_sentencepiece_adds_bos_and_eos_as_the_file_says():
    assert spm_tokenizer().encode("Hello") == [1, HELLO]  # llama.cpp's default for these vocabularies: BOS
    assert spm_tokenizer(**{"tokenizer.ggml.add_bos_token": False}).encode("Hello") == [HELLO]
    assert spm_tokenizer(**{"tokenizer.ggml.add_eos_token": True}).encode("Hello") == [1, HELLO, 2]
    assert spm_tokenizer().decode([1, HELLO, 2], skip_special_tokens=True) == "Hello"


def test_a_vocabulary_the_tokenizers_library_cannot_build_is_a_value_error_naming_the_file(tmp_path):
    """The tokenizers library raises a bare Exception for a merge of tokens the
    vocabulary lacks: a traceback and exit 1 from `heron serve` and `heron
    generate`, where a tokenizer that does not load is a usage error (exit 2)."""
    from gguf import GGUFWriter

    from heron.loader.tokenizer import load_gguf_tokenizer

    path = str(tmp_path / "vocab.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a c"])  # "c" is no token
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"vocab\.gguf: the GGUF's 'gpt2' vocabulary cannot be built \(Exception: "):
        load_gguf_tokenizer(path)
