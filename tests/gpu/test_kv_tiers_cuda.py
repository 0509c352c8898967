"""KV connectors on a CUDA pool (float32, tiny random Llama): the host tier is
pinned memory and serves a prefix the pool evicted, the disk tier serves a
restarted engine, a decode engine pulls a prefill engine's blocks over TCP,
each with greedy output token-identical to transformers and the pool's books
balanced; and the pool takes all of the budget --gpu-memory-utilization leaves."""

from __future__ import annotations

import gc

import pytest
import torch

from heron import LLM, SamplingParams
from tests.gpu.conftest import prompts, reference_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# 12 blocks of 16 tokens: one request's prompt and output, not two prompts' prefixes
POOL = dict(dtype="float32", device="cuda", num_kv_blocks=12, max_model_len=160, max_num_seqs=8)


@pytest.fixture(scope="module")
def workload(tiny_llama):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                     attn_implementation="eager").cuda().eval()
    shared, = prompts([96], seed=21)
    with_prefix = [shared + tail for tail in prompts([3, 9, 5], seed=22)]
    fillers = prompts([100, 110, 90], seed=23)  # enough to push the shared prefix out of the pool
    expected = {tuple(p): reference_greedy(reference, p, NEW_TOKENS) for p in with_prefix + fillers}
    return with_prefix, fillers, expected


def check(llm: LLM, batch: list[list[int]], expected: dict) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in batch]
    return outputs


def settled(llm: LLM) -> None:
    engine = llm.engine.engine_core
    while engine.has_unfinished_requests():
        engine.step()
    manager = engine.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("situation", [
    dict(),  # CUDA graphs for the decodes
    dict(max_num_batched_tokens=32),  # chunked prefill on top of loaded blocks
    dict(async_scheduling=True),  # loads queued while the previous step runs
])
def test_the_pinned_host_tier_serves_an_evicted_prefix(tiny_llama, workload, situation):
    with_prefix, fillers, expected = workload
    llm = LLM(tiny_llama, kv_offloading_size=0.01, **POOL, **situation)
    store = llm.engine.engine_core.model_runner.offload_store
    assert store is not None and store.pinned and all(s.is_pinned() for s in store.store)
    check(llm, with_prefix[:1], expected)
    check(llm, fillers, expected)  # evicts the shared prefix: saved to the tier
    offload = llm.engine.engine_core.scheduler.kv_cache_manager.offload
    assert offload is not None and offload.stats.stored >= 6
    check(llm, with_prefix[1:], expected)  # misses the pool, loaded from the tier
    assert offload.stats.loaded >= 6 and offload.stats.hit_tokens >= 6 * 16
    settled(llm)


def test_a_restarted_engine_answers_from_the_disk_tier(tiny_llama, workload, tmp_path):
    with_prefix, _, expected = workload
    first = LLM(tiny_llama, kv_offloading_dir=str(tmp_path), **POOL)
    check(first, with_prefix[:1], expected)
    first.engine.engine_core.shutdown()  # finishes the writes
    second = LLM(tiny_llama, kv_offloading_dir=str(tmp_path), **POOL)
    outputs = check(second, with_prefix[1:], expected)
    disk = second.engine.engine_core.scheduler.kv_cache_manager.disk
    assert disk is not None and disk.stats.loaded >= 6 and disk.stats.load_failures == 0
    assert all(o.num_cached_tokens >= 96 for o in outputs)
    store = second.engine.engine_core.model_runner.disk_store
    assert store is not None and store.flush()
    settled(second)


def test_a_decode_engine_pulls_blocks_from_a_prefill_engine(tiny_llama, workload):
    with_prefix, fillers, expected = workload
    batch = with_prefix[:1] + fillers[:2]
    pools = {**POOL, "num_kv_blocks": 48}  # the prefill engine holds all three prompts' blocks under lease
    prefill = LLM(tiny_llama, kv_transfer_config={"kv_role": "kv_producer"}, **pools)
    decode = LLM(tiny_llama, kv_transfer_config={"kv_role": "kv_consumer", "kv_timeout_seconds": 5}, **pools)
    to_decode = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
    handed = prefill.generate([{"prompt_token_ids": p} for p in batch], to_decode, use_tqdm=False)
    for prompt, first in zip(batch, handed, strict=True):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                kv_transfer_params=first.kv_transfer_params)
        output, = decode.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert output.outputs[0].token_ids == expected[tuple(prompt)]
        assert output.num_cached_tokens == (len(prompt) - 1) // 16 * 16  # pulled, not prefilled
    settled(prefill)
    settled(decode)


def test_the_pool_takes_the_whole_budget(tiny_llama):
    """Two requests of 128 tokens need 16 blocks; the pool gets every block the
    budget holds (about 3 GiB here), not 16."""
    gc.collect()  # earlier tests' engines, so the budget below is this test's alone
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free + (4 << 30)) / total)
    llm = LLM(tiny_llama, dtype="float32", device="cuda", max_num_seqs=2, max_model_len=128,
              gpu_memory_utilization=utilization)
    engine = llm.engine.engine_core
    num_blocks = engine.scheduler.kv_cache_manager.num_blocks
    pool_bytes = num_blocks * engine.model_runner.kv_cache_bytes_per_block()
    assert (1 << 30) < pool_bytes < (4 << 30)
    assert check_serves(llm)
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()


def check_serves(llm: LLM) -> bool:
    output, = llm.generate([{"prompt_token_ids": prompts([40], seed=5)[0]}], GREEDY, use_tqdm=False)
    return len(output.outputs[0].token_ids) == NEW_TOKENS


@pytest.mark.parametrize("slots", [
    [2, 3, 4, 6, 0],  # runs: a copy per run and layer
    [6, 0, 4, 2, 5],  # every slot alone: through pinned staging
])
def test_the_host_tier_round_trips_blocks(slots):
    """Pool blocks in any order, float32 and bf16 layers."""
    from heron.core.kv_offload import KVTransfers
    from heron.worker.kv_offload_store import HostKVStore

    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 9, 16, 2, 64, generator=generator).to(dtype).cuda()
              for dtype in (torch.float32, torch.bfloat16)]
    originals = [cache.clone() for cache in caches]
    store = HostKVStore(caches, num_slots=7)
    assert store.pinned
    sources, targets = [8, 1, 5, 0, 3], [1, 2, 3, 7, 4]
    store.apply(KVTransfers(saves=list(zip(sources, slots))))
    for cache in caches:
        cache.zero_()
    store.apply(KVTransfers(loads=list(zip(slots, targets))))
    torch.cuda.synchronize()
    for cache, original in zip(caches, originals):
        for source, target in zip(sources, targets):
            assert torch.equal(cache[:, target], original[:, source])
        assert not cache[:, [0, 5, 6, 8]].any()


def test_a_scattered_load_waits_for_the_saves_queued_before_it():
    """One step saves a block into slot 10 (a run: queued, no wait) and loads
    slot 10 among scattered slots (gathered by the host): the host must read
    the saved block, not what the slot held, though the stream is still busy
    with work queued ahead of the save."""
    from heron.core.kv_offload import KVTransfers
    from heron.worker.kv_offload_store import HostKVStore

    caches = [torch.randn(2, 12, 16, 2, 64, generator=torch.Generator().manual_seed(1)).cuda()]
    original = caches[0].clone()
    store = HostKVStore(caches, num_slots=16)
    for slot in range(16):
        store.store[0][slot].fill_(-1.0)
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles ahead of the save's copies
    store.apply(KVTransfers(saves=[(3, 10)], loads=[(10, 0), (1, 2), (5, 4), (7, 6), (12, 8)]))
    torch.cuda.synchronize()
    assert torch.equal(caches[0][:, 0], original[:, 3])
    assert (caches[0][:, 2] == -1.0).all()
