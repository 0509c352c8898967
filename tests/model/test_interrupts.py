"""An interrupt (Ctrl-C, offline) inside a step's forward pass leaves nothing
behind that the next call could read: the blocks the step registered in the
prefix cache were never written, and the same prompt answered from them."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams
from tests.model.conftest import load_reference, random_prompts, reference_greedy


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("budget, interrupt_at", [(16, 2), (16, 3), (64, 1)])
def test_an_interrupted_prefill_leaves_no_unwritten_blocks_cached(tiny_model_dir, monkeypatch, budget, interrupt_at,
                                                                  async_scheduling):
    """Interrupted mid-prompt (the first chunk computed), in the step that
    completes it, or in its only prefill step. With async scheduling the step
    that completes a prompt gives the request an output placeholder, and the
    undo skipped such requests: the prompt's blocks stayed cached unwritten."""
    directory = tiny_model_dir("llama")
    [prompt] = random_prompts([40], seed=21)
    expected = reference_greedy(load_reference(directory), prompt, 8)
    llm = LLM(directory, dtype="float32", max_model_len=96, block_size=8, num_kv_blocks=32,
              max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    runner = llm.engine.engine_core.model_runner
    execute_model, calls = runner.execute_model, []

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


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_interrupt_before_the_forward_pass_is_undone_too(tiny_model_dir, async_scheduling):
    """Between schedule() and the forward pass (grammar masks, the idle waits)
    an interrupt was outside the undo: the step's blocks stayed cached unwritten."""
    directory = tiny_model_dir("llama")
    [prompt] = random_prompts([40], seed=21)
    expected = reference_greedy(load_reference(directory), prompt, 8)
    llm = LLM(directory, dtype="float32", max_model_len=96, block_size=8, num_kv_blocks=32,
              async_scheduling=async_scheduling)
    scheduler = llm.engine.engine_core.scheduler
    to_sample = scheduler.structured_requests_to_sample

    def interrupted(*args):
        scheduler.structured_requests_to_sample = to_sample  # once
        raise KeyboardInterrupt

    scheduler.structured_requests_to_sample = interrupted
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    [output] = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert output.outputs[0].token_ids == expected
    scheduler.kv_cache_manager.check_integrity()


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def interrupt_the_step(monkeypatch, llm: LLM, when) -> list[int]:
    """Raise KeyboardInterrupt as the first step for which ``when(scheduler_output)``
    holds starts (before its tier copies are made); returns a list that gets a 1 then."""
    runner = llm.engine.engine_core.model_runner
    execute_model, raised = runner.execute_model, []

    def interrupted(scheduler_output, *args, **kwargs):
        if not raised and when(scheduler_output):
            raised.append(1)
            raise KeyboardInterrupt
        return execute_model(scheduler_output, *args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", interrupted)
    return raised


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids)
            for output in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]


def test_an_interrupt_before_a_steps_host_tier_saves_leaves_the_tier_true(tiny_model_dir, monkeypatch):
    """The host tier listed the blocks a step evicted into it when the step was
    scheduled; interrupted before its copies, the slots kept stale bytes under
    those hashes, and a later prompt with that prefix was answered from them."""
    directory = tiny_model_dir("llama")
    shared, = random_prompts([48], seed=31)
    tail, = random_prompts([9], seed=32)
    fillers = random_prompts([40, 44, 36], seed=33)
    expected = reference_greedy(load_reference(directory), shared + tail, 8)
    llm = LLM(directory, dtype="float32", block_size=8, num_kv_blocks=12, max_model_len=96, kv_offloading_size=1e-4)
    generate(llm, [shared + tail[:3]])
    raised = interrupt_the_step(monkeypatch, llm, lambda out: out.kv_transfers and out.kv_transfers.saves)
    with pytest.raises(KeyboardInterrupt):
        generate(llm, fillers)  # its first step evicts the shared prefix into the host tier
    assert raised
    generate(llm, fillers)
    assert generate(llm, [shared + tail]) == [expected]
    assert llm.engine.engine_core.scheduler.kv_cache_manager.offload.stats.loaded > 0  # from the tier


def test_an_interrupt_before_a_steps_disk_loads_start_leaks_nothing(tiny_model_dir, monkeypatch, tmp_path):
    """A disk load the interrupted step never started held its request (aborted)
    in the loading state and its pool blocks for ever."""
    directory = tiny_model_dir("llama")
    shared, = random_prompts([48], seed=31)
    tail, = random_prompts([5], seed=32)
    expected = reference_greedy(load_reference(directory), shared + tail, 8)
    pool = dict(dtype="float32", block_size=8, num_kv_blocks=32, max_model_len=96, kv_offloading_dir=str(tmp_path))
    with LLM(directory, **pool) as first:
        generate(first, [shared + tail])  # the prefix on disk
    llm = LLM(directory, **pool)
    raised = interrupt_the_step(monkeypatch, llm, lambda out: out.kv_transfers and out.kv_transfers.disk.loads)
    with pytest.raises(KeyboardInterrupt):
        generate(llm, [shared + tail])
    assert raised
    assert generate(llm, [shared + tail]) == [expected]
    core = llm.engine.engine_core
    for _ in range(20):
        if not core.scheduler.has_unfinished_requests():
            break
        core.step()
    manager = core.scheduler.kv_cache_manager
    assert not core.scheduler.has_unfinished_requests()
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks
    llm.shutdown()


def test_ctrl_c_is_not_held_while_the_disk_tier_waits_for_its_writer(tiny_model_dir, tmp_path):
    """The tier copies are held against Ctrl-C, and they began with a wait for
    room in the disk writer's buffer: a stuck disk held Ctrl-C for ever."""
    import os
    import signal
    import threading
    import time

    directory = tiny_model_dir("llama")
    llm = LLM(directory, dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=128,
              kv_offloading_dir=str(tmp_path), max_num_batched_tokens=16)
    store = llm.engine.engine_core.model_runner.disk_store
    store.max_buffered_bytes = 1  # every step's writes wait for the last ones
    disk_back = threading.Event()
    write_file = store._write_file

    def stuck(*args, **kwargs):
        disk_back.wait(60)
        return write_file(*args, **kwargs)

    store._write_file = stuck
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    prompts = random_prompts([60, 60, 60], seed=3)
    with pytest.raises(KeyboardInterrupt):
        generate(llm, prompts)
    assert time.monotonic() - started < 10
    disk_back.set()
    [expected] = generate(LLM(directory, dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=128),
                          prompts[:1])
    assert generate(llm, prompts[:1]) == [expected]  # the interrupted step's copies were made whole
    manager = llm.engine.engine_core.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks
    llm.shutdown()
