"""An interrupt (Ctrl-C, offline) inside a step's forward pass leaves nothing
behind that the next call could read: the blocks the step registered in the
prefix cache were never written, and the same prompt answered from them."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams
from tests.model.conftest import load_reference, random_prompts, reference_greedy


@pytest.mark.parametrize("budget", [16, 64])  # the prompt in chunks, or whole
def test_an_interrupted_prefill_leaves_no_unwritten_blocks_cached(tiny_model_dir, monkeypatch, budget):
    directory = tiny_model_dir("llama")
    [prompt] = random_prompts([40], seed=21)
    expected = reference_greedy(load_reference(directory), prompt, 8)
    llm = LLM(directory, dtype="float32", max_model_len=96, block_size=8, num_kv_blocks=32,
              max_num_batched_tokens=budget)
    runner = llm.engine.engine_core.model_runner
    execute_model, calls = runner.execute_model, []
    interrupt_at = 2 if budget == 16 else 1  # mid-prompt (the first chunk computed), or its only prefill step

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return execute_model(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", interrupted)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    [output] = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert output.outputs[0].token_ids == expected
    manager = llm.engine.engine_core.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks
