"""A tokenizer that knows more tokens than the model's vocabulary (``--tokenizer``
from another model, a fine-tune that added tokens without resizing its
embeddings): a text prompt using the extra ids is refused as a bad request,
and the engine serves on. The engine core died on them (IndexError in the
embedding) and every later request got engine_dead."""

from __future__ import annotations

import logging

import pytest

from heron import LLM, SamplingParams
from tests.model.conftest import build_tiny_model


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, embedded_tokenizer):
    directory = str(tmp_path_factory.mktemp("small_vocab"))
    return build_tiny_model(directory, {"model_type": "llama", "vocab_size": 1000}, embedded_tokenizer)


def test_a_text_prompt_past_the_vocabulary_is_refused_and_the_engine_serves_on(small_vocab_model, caplog):
    with caplog.at_level(logging.WARNING, logger="heron.engine.input_processor"):
        llm = LLM(small_vocab_model, dtype="float32", max_model_len=64, num_kv_blocks=16)
    assert "the tokenizer has 49152 tokens, the model's vocabulary 1000" in caplog.text
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=r"out of the model's vocabulary \(size 1000\).*tokenizer knows more"):
        llm.generate(["Hello world"], greedy, use_tqdm=False)  # [19556, 905]
    with pytest.raises(ValueError, match="out of the model's vocabulary"):
        llm.chat([{"role": "user", "content": "Hello"}], greedy, use_tqdm=False)
    output = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4
