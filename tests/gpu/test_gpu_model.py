"""The engine on CUDA: greedy output token-identical to transformers (float32)
for ragged prompts with chunked prefill, prefix hits and preemption; bf16 agrees
on the first tokens with close logprobs."""

from __future__ import annotations

import pytest
import torch

from heron import LLM, SamplingParams
from tests.gpu.conftest import prompts, reference_greedy

pytestmark = pytest.mark.gpu


def test_greedy_matches_transformers_fp32_on_cuda(tiny_llama):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                     attn_implementation="eager").cuda().eval()
    batch = prompts([5, 17, 33, 70, 1, 128, 16, 40])
    expected = [reference_greedy(reference, p, 16) for p in batch]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for settings in (
        dict(),  # plain
        dict(max_num_batched_tokens=32),  # chunked prefill mixed with decodes
        dict(num_kv_blocks=11, max_model_len=160),  # too small: preemption
    ):
        llm = LLM(tiny_llama, dtype="float32", device="cuda",
                  **{"max_model_len": 512, "num_kv_blocks": 256, **settings})
        assert llm.engine.engine_core.model_runner.backend.name == "triton"
        outputs = llm.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, settings
        if "num_kv_blocks" in settings:
            assert llm.engine.engine_core.scheduler.num_preemptions > 0
        # prefix hits: the same prompts again reuse their cached blocks
        again = llm.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected
        llm.engine.engine_core.scheduler.kv_cache_manager.check_integrity()


def test_bf16_agrees_on_first_tokens(tiny_llama):
    batch = prompts([12, 40, 7, 25, 60], seed=2)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    fp32, bf16 = (LLM(tiny_llama, dtype=dtype, device="cuda", max_model_len=512, num_kv_blocks=64)
                  .generate(batch, params, use_tqdm=False) for dtype in ("float32", "bfloat16"))
    for a, b in zip(fp32, bf16):
        top_fp32 = sorted(a.outputs[0].logprobs[0].values(), key=lambda lp: lp.rank)
        top_bf16 = {tid: lp.logprob for tid, lp in b.outputs[0].logprobs[0].items()}
        first = a.outputs[0].token_ids[0]
        # the fp32 choice is among bf16's top five with a close logprob
        assert first in top_bf16 and abs(top_bf16[first] - a.outputs[0].logprobs[0][first].logprob) < 0.1
        if top_fp32[0].logprob - top_fp32[1].logprob > 0.1:  # a clear winner must win in bf16 too
            assert b.outputs[0].token_ids[0] == first


def test_cuda_defaults(tiny_llama):
    from heron.engine.args import EngineArgs

    config = EngineArgs(model=tiny_llama, device="cuda", usage="serve").create_engine_config()
    assert config.scheduler.max_num_seqs == 256 and config.scheduler.max_num_batched_tokens == 2048
