"""Hypothesis against the text path without a server (issue #20, item 4): the
prompt and chat-template input, the tokenizer, and both incremental
detokenizers, on the embedded model's tokenizer and on a byte-fallback one.

- any Python string as a prompt or a chat message: token ids inside the
  vocabulary, or ``InvalidRequestError`` naming the field (lone surrogates);
- text round-trips through the tokenizer, but for the bytes the model's
  vocabulary lacks (SmolLM2 has no token for 21 of the 256 byte values, six
  ASCII control characters among them: the tokenizer drops them, as
  transformers' does with the model's own tokenizer.json);
- any token ids, special tokens and byte pieces that are not UTF-8 included:
  the streamed pieces concatenate to ``tokenizer.decode`` of the same ids, and
  no piece but the last ends inside a character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heron.engine.detokenizer import IncrementalDetokenizer, StreamingDetokenizer
from heron.engine.input_processor import InputProcessor, InvalidRequestError
from tests.unit.test_detokenizer import byte_fallback_tokenizer

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
DETOKENIZERS = [IncrementalDetokenizer, StreamingDetokenizer]


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    from heron.engine.args import EngineArgs
    from heron.loader.tokenizer import load_tokenizer

    config = EngineArgs(model=None, device="cpu").create_engine_config()
    return InputProcessor(config.model, load_tokenizer(config.model))


def is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@FUZZ
@given(text=st.text(max_size=300))
def test_any_string_as_a_prompt(processor, text):
    try:
        prompt = processor.process_prompt(text)
    except InvalidRequestError as exc:
        assert exc.param == "prompt"
        assert not text or not is_unicode(text)
        return
    assert text and is_unicode(text)
    assert all(0 <= t < processor.vocab_size for t in prompt.token_ids)


@FUZZ
@given(
    contents=st.lists(st.text(max_size=80) | st.none(), min_size=1, max_size=4),
    roles=st.lists(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), min_size=4, max_size=4),
    generation=st.booleans(),
    continue_final=st.booleans(),
)
def test_any_chat_messages_render_or_name_messages(processor, contents, roles, generation, continue_final):
    messages = [{"role": role, "content": content} for role, content in zip(roles, contents)]
    try:
        prompt = processor.process_chat(
            messages, add_generation_prompt=generation, continue_final_message=continue_final
        )
    except InvalidRequestError as exc:
        assert exc.param == "messages"
        return
    assert prompt.text is not None and all(0 <= t < processor.vocab_size for t in prompt.token_ids)
    for content in contents:  # every message's text is in the prompt, unaltered
        assert (content or "").strip() in prompt.text


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table of byte-level BPE: printable Latin-1
    bytes stand for themselves, the rest for U+0100 onwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + i) for i, b in enumerate(others)}}


@pytest.fixture(scope="module")
def missing_bytes(processor) -> set[int]:
    vocab = processor.tokenizer.get_vocab()
    return {byte for byte, char in byte_level_alphabet().items() if char not in vocab}


def test_the_vocabulary_lacks_only_bytes_no_printable_text_needs(missing_bytes):
    assert len(missing_bytes) == 21
    assert all(b < 0x20 or b in (0xC0, 0xC1) or b >= 0xF1 for b in missing_bytes)


@FUZZ
@given(text=st.text(st.characters(exclude_categories=["Cs"]), max_size=300))
def test_text_round_trips_through_the_tokenizer(processor, missing_bytes, text):
    tokenizer = processor.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    kept = bytes(b for b in text.encode("utf-8") if b not in missing_bytes)
    assert tokenizer.decode(ids, skip_special_tokens=False) == kept.decode("utf-8", errors="replace")


def stream_pieces(cls, tokenizer, ids: list[int], skip_special_tokens: bool) -> list[str]:
    detokenizer = cls(tokenizer, [], skip_special_tokens)
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


def check_pieces(tokenizer, ids: list[int], skip_special_tokens: bool, exact: bool = True) -> None:
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    for cls in DETOKENIZERS:
        pieces = stream_pieces(cls, tokenizer, ids, skip_special_tokens)
        if exact:
            assert "".join(pieces) == expected, (cls.__name__, ids)
        assert not any(piece.endswith("\ufffd") for piece in pieces[:-1]) or "\ufffd" in expected


@FUZZ
@given(ids=st.lists(st.integers(0, 49151), max_size=40), skip=st.booleans())
def test_any_token_ids_stream_to_the_full_decode(processor, ids, skip):
    check_pieces(processor.tokenizer, ids, skip)


@FUZZ
@given(data=st.data(), skip=st.booleans())
def test_byte_level_pieces_of_characters_stream_to_the_full_decode(processor, data, skip):
    """Ids that split multi-byte characters, in and out of order: GPT-2 byte
    pieces of random characters, shuffled and cut at random."""
    tokenizer = processor.tokenizer
    text = data.draw(st.text(st.characters(min_codepoint=0x80, exclude_categories=["Cs"]), min_size=1, max_size=12))
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = data.draw(st.permutations(ids))[: data.draw(st.integers(1, len(ids)))]
    check_pieces(tokenizer, list(ids), skip)


@FUZZ
@given(pieces=st.lists(st.sampled_from([f"<0x{b:02X}>" for b in range(256)] + ["▁a", "▁b", "c"]), max_size=30))
def test_byte_fallback_ids_that_are_not_utf8_stream_to_the_full_decode(pieces):
    """Where a run of byte tokens is not UTF-8, tokenizers' ByteFallback
    decoder turns every byte of the run into U+FFFD, the valid ones too
    (<0x00><0x80> decodes to two), while a stream has already sent the valid
    prefix ("\\x00", then one U+FFFD): the texts agree wherever the bytes are UTF-8."""
    tokenizer = byte_fallback_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids(p) for p in pieces]
    check_pieces(tokenizer, ids, True, exact="\ufffd" not in tokenizer.decode(ids))


def test_a_developer_message_is_a_system_message_where_the_template_has_no_developer(processor):
    """The embedded template rendered its default system prompt and then a
    `<|im_start|>developer` turn; OpenAI's developer role is the system role."""
    developer = processor.render_chat([{"role": "developer", "content": "Be terse."},
                                       {"role": "user", "content": "Hi"}])
    system = processor.render_chat([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    assert developer == system and "developer" not in developer
    own = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{# knows developer #}"
    kept = processor.render_chat([{"role": "developer", "content": "x"}], chat_template=own)
    assert kept.startswith("<developer>x")
