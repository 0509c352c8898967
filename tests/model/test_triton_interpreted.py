"""The Triton attention backend end to end on the CPU, in Triton's interpreter
(tests/conftest.py turns it on where no GPU is present): every fused kernel
(add + RMSNorm, Q/K norm + RoPE + cache write, SiLU * up) and the paged
attention kernel (split-KV decode included) inside the real engine, as on CUDA, with
chunked prefill mixed with decodes, prefix-cache hits and preemption. Greedy
tokens must be identical to transformers (float32), as on a GPU
(tests/gpu/test_gpu_model.py checks the compiled kernels and CUDA graphs)."""

from __future__ import annotations

import os

import pytest
import torch

from heron import LLM, SamplingParams
from tests.model.conftest import load_reference, random_prompts, reference_greedy

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels in the CPU interpreter",
)

NEW_TOKENS = 10


@pytest.mark.parametrize(
    "family, settings",
    [
        ("llama", dict(max_num_batched_tokens=24, num_kv_blocks=64)),  # chunked, mixed with decodes
        ("qwen3", dict(max_num_batched_tokens=24, num_kv_blocks=64)),  # per-head Q/K norms in the kernel
        ("mistral-sliding-window", dict(num_kv_blocks=9)),  # too few blocks: preemption
    ],
)
def test_triton_backend_greedy_matches_transformers(tiny_model_dir, family, settings, monkeypatch):
    # on CUDA every norm and SiLU goes through the fused kernels too: do so here
    from heron.attention import triton_backend
    from heron.models.layers import triton_ops

    for module in ("heron.models.layers.norm", "heron.models.llama"):
        monkeypatch.setattr(f"{module}.fused_kernels_for", lambda x: triton_ops)
    splits_used = []  # decode-only steps of few requests split their keys (the interpreter's stand-in device is small)
    real_choose_kv_splits = triton_backend.choose_kv_splits

    def choose_kv_splits(*args: int) -> int:
        splits_used.append(real_choose_kv_splits(*args))
        return splits_used[-1]

    monkeypatch.setattr(triton_backend, "choose_kv_splits", choose_kv_splits)
    directory = tiny_model_dir(family)
    llm = LLM(directory, dtype="float32", max_model_len=128, attention_backend="triton", **settings)
    assert llm.engine.engine_core.model_runner.backend.attends_from_cache
    reference = load_reference(directory)
    prompts = random_prompts([5, 17, 33, 40, 1])
    expected = [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    scheduler = llm.engine.engine_core.scheduler
    if settings.get("num_kv_blocks", 64) < 16:
        assert scheduler.num_preemptions > 0
    else:  # the same prompts again start from their cached blocks
        again = llm.generate(prompts[1:3], params, use_tqdm=False)  # 17 and 33 tokens: full blocks
        assert [output.outputs[0].token_ids for output in again] == expected[1:3]
        assert all(output.num_cached_tokens > 0 for output in again)
    scheduler.kv_cache_manager.check_integrity()
    assert max(splits_used) > 1 and min(splits_used) == 1
