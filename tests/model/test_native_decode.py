"""The native decode path of 4-bit models (one C call per decode step) computes
what the torch path computes: same tokens, logprobs equal to float32 rounding,
in every batching situation (decodes beside prefill chunks fall back to torch,
batches over 16 rows too, preemption, prefix hits, sliding windows)."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams
from heron.attention import cpu_kernels
from heron.models.native_decode import NativeQ4Decoder
from tests.model.conftest import random_prompts

pytestmark = pytest.mark.skipif(cpu_kernels.native_library() is None, reason="needs a C compiler")

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)


def run(llm: LLM, prompts: list[list[int]], native: bool) -> list[tuple[list[int], list[dict]]]:
    model = llm.engine.engine_core.model_runner.model
    decoder = model.native_decoder
    calls = {"native": 0}
    if native:
        original = decoder.__call__

        class Counting:  # counts the steps that really ran natively
            def covers(self, *args):
                return decoder.covers(*args)

            def __call__(self, *args):
                calls["native"] += 1
                return original(*args)

        model.native_decoder = Counting()
    else:
        model.native_decoder = None
    try:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    finally:
        model.native_decoder = decoder
    if native:
        assert calls["native"] > 0
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("family", ["llama", "llama3-rope-untied", "mistral-sliding-window"])
def test_native_decode_matches_the_torch_path(tiny_model_dir, family):
    directory = tiny_model_dir(family)
    prompts = random_prompts([5, 17, 33, 40, 9, 21], seed=11)
    for situation in (dict(num_kv_blocks=64), dict(num_kv_blocks=64, max_num_batched_tokens=24),
                      dict(num_kv_blocks=9, block_size=8, max_model_len=64)):
        llm = LLM(directory, quantization="int4", **{"max_model_len": 128, **situation})
        assert isinstance(llm.engine.engine_core.model_runner.model.native_decoder, NativeQ4Decoder)
        torch_path = run(llm, prompts, native=False)
        native = run(llm, prompts, native=True)
        for (tokens, logprobs), (native_tokens, native_logprobs) in zip(torch_path, native):
            assert native_tokens == tokens, situation
            for position, native_position in zip(logprobs, native_logprobs):
                for token_id, entry in position.items():
                    assert abs(native_position[token_id].logprob - entry.logprob) < 1e-4


def test_batches_over_sixteen_rows_use_the_torch_path(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), quantization="int4", max_model_len=128, num_kv_blocks=256)
    decoder = llm.engine.engine_core.model_runner.model.native_decoder
    assert decoder is not None
    metadata = type("Metadata", (), {"all_decode": True, "decode_block_table": object()})()
    assert decoder.covers(16, metadata) and not decoder.covers(17, metadata)
    metadata.all_decode = False
    assert not decoder.covers(1, metadata)
