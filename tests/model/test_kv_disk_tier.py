"""The disk KV tier on a tiny random Llama (float32, CPU): prefixes written
through to a directory are loaded back (in the background, the request waiting
in its own state) instead of recomputed, by the same engine once the pool has
evicted them, by a restarted engine, and by another engine sharing the
directory; missing or corrupt files are recomputed or fail the request per
policy; an abort during a load frees everything. Greedy output stays
token-identical to transformers throughout and the pool's books balance."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from heron import LLM, SamplingParams
from heron.core import kv_disk_index
from heron.core.hashing import prompt_block_hashes
from heron.core.kv_disk_layout import HEADER_BYTES
from heron.engine.core import EngineCore
from heron.request import EngineCoreRequest, RequestStatus
from tests.model.conftest import load_reference, random_prompts, reference_greedy

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
POOL = dict(dtype="float32", block_size=8, num_kv_blocks=12, max_model_len=96)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    directory = tiny_model_dir("llama")
    shared, = random_prompts([48], seed=31)
    tails = random_prompts([3, 9, 5], seed=32)
    fillers = random_prompts([40, 44, 36], seed=33)  # enough to push the shared prefix out of the pool
    reference = load_reference(directory)
    with_prefix = [shared + tail for tail in tails]
    expected = {tuple(prompt): reference_greedy(reference, prompt, NEW_TOKENS) for prompt in with_prefix + fillers}
    return directory, with_prefix, fillers, expected


def generate(llm: LLM, prompts: list[list[int]]) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]


def check(llm: LLM, prompts: list[list[int]], expected: dict) -> None:
    assert [o.token_ids for o in generate(llm, prompts)] == [expected[tuple(p)] for p in prompts]


def core(llm: LLM) -> EngineCore:
    return llm.engine.engine_core


def disk_stats(llm: LLM):
    disk = core(llm).scheduler.kv_cache_manager.disk
    assert disk is not None
    return disk.stats


def settle(llm: LLM) -> None:
    """Every block written, the pool's books balanced and every block free."""
    store = core(llm).model_runner.disk_store
    assert store is not None and store.flush()
    assert not store._buffered  # noqa: SLF001 (written blocks leave host memory: they all stayed there)
    manager = core(llm).scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks and not manager.loading


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kv"))


@pytest.mark.parametrize("situation", [
    dict(),
    dict(max_num_batched_tokens=16),  # chunked prefill on top of loaded blocks
    dict(async_scheduling=True),
    dict(kv_offloading_size=1e-5),  # a host tier in front: some blocks from memory, the rest from disk
])
def test_an_evicted_prefix_is_loaded_from_disk(llama, tmp_path, situation):
    directory, with_prefix, fillers, expected = llama
    llm = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL, **situation)
    check(llm, with_prefix[:1], expected)
    check(llm, fillers, expected)  # evicts the shared prefix from the pool
    check(llm, with_prefix[1:], expected)  # misses the pool, hits the disk tier
    stats = disk_stats(llm)
    assert stats.stored >= 6 and stats.load_failures == 0
    host = core(llm).scheduler.kv_cache_manager.offload
    loaded = stats.loaded + (host.stats.loaded if host is not None else 0)
    assert loaded >= 6 and stats.hit_tokens + (host.stats.hit_tokens if host is not None else 0) >= 6 * 8
    settle(llm)
    assert len(block_files(tmp_path)) == stats.stored
    engine_stats = core(llm).scheduler.make_stats()
    assert engine_stats.kv_disk_loaded == stats.loaded and engine_stats.kv_disk_blocks == stats.stored


def test_a_restarted_engine_answers_from_disk(llama, tmp_path):
    directory, with_prefix, _, expected = llama
    first = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    check(first, with_prefix[:1], expected)
    core(first).shutdown()  # finishes the writes
    second = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    assert len(core(second).scheduler.kv_cache_manager.disk) == len(block_files(tmp_path)) >= 6
    check(second, with_prefix[1:], expected)
    assert disk_stats(second).loaded >= 6  # the shared prefix was not prefilled again
    settle(second)


def test_engines_sharing_a_directory_share_prefixes(llama, tmp_path):
    directory, with_prefix, _, expected = llama
    first = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    second = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    check(first, with_prefix[:1], expected)
    settle(first)
    check(second, with_prefix[1:2], expected)  # found by a file-system lookup: second never saw it
    assert disk_stats(second).loaded >= 6 and disk_stats(second).stored < disk_stats(first).stored
    settle(second)


def test_a_directory_removed_while_running_is_made_again(llama, tmp_path):
    """A cleaner (or an operator freeing space) removed the tier's directory:
    every later write failed, for good, until a restart."""
    import shutil

    directory, with_prefix, fillers, expected = llama
    tier = tmp_path / "tier"
    llm = LLM(directory, kv_offloading_dir=str(tier), **POOL)
    check(llm, with_prefix[:1], expected)
    settle(llm)
    shutil.rmtree(tier)
    check(llm, fillers, expected)  # written through to a directory that is gone
    settle(llm)
    assert block_files(tier)  # made again, and written


def test_blocks_a_full_disk_could_not_take_are_not_counted_held(llama, tmp_path, monkeypatch):
    """The index counted every block written through as held though its write
    failed (a full disk): /metrics said 42 blocks where 5 files were, and a
    request whose prefix was 'stored' there failed under the fail policy."""
    import errno

    from heron.worker.kv_disk_store import DiskKVStore

    def disk_full(self, block_hash, buffer):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskKVStore, "_write_file", disk_full)
    directory, with_prefix, fillers, expected = llama
    llm = LLM(directory, kv_offloading_dir=str(tmp_path), kv_load_failure_policy="fail", **POOL)
    check(llm, with_prefix[:1], expected)
    settle(llm)
    check(llm, fillers, expected)  # its first step takes the failed writes back; the prefix leaves the pool
    settle(llm)
    check(llm, with_prefix[1:], expected)  # recomputed: the tier never claimed its prefix
    stats = disk_stats(llm)
    assert stats.load_failures == 0 and stats.loaded == 0
    assert len(core(llm).scheduler.kv_cache_manager.disk) == stats.stored <= 3 * 6  # at most the last step's
    assert not block_files(tmp_path)


def test_a_slow_lookup_holds_up_no_one(llama, tmp_path, monkeypatch):
    """A file system too slow to ask inline (a budget of 0: every lookup goes
    to the background prober, whose stats of existing files are held until
    released): the request whose prefix the other engine wrote waits at the
    head of the queue while a request behind it runs to the end; released, it
    loads the prefix from disk, and both outputs match transformers."""
    monkeypatch.setattr(kv_disk_index, "INLINE_LOOKUP_BUDGET_S", 0.0)
    directory, with_prefix, fillers, expected = llama
    first = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    second = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    engine = core(second)
    check(first, with_prefix[:1], expected)
    settle(first)
    released = threading.Event()
    is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda path: (is_file(path) and released.wait(30)) or False)
    prompts = {"shared": with_prefix[1], "other": fillers[0]}
    for request_id, prompt in prompts.items():
        engine.add_request(EngineCoreRequest(request_id, prompt, GREEDY, (), NEW_TOKENS, time.time()))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    finished: set[str] = set()

    def step() -> None:
        for output in engine.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finished.add(output.request_id)

    while "other" not in finished:
        step()
    assert finished == {"other"} and tokens["shared"] == []
    assert engine.scheduler.requests["shared"].status == RequestStatus.WAITING
    released.set()
    while engine.has_unfinished_requests():
        step()
    assert [tokens[request_id] for request_id in prompts] == [expected[tuple(p)] for p in prompts.values()]
    assert disk_stats(second).loaded >= 6  # the prefix came from disk, not recomputed
    settle(second)


def _written_then_damaged(llama, tmp_path, damage, **engine_args) -> tuple[LLM, list[list[int]], dict]:
    """An engine started on a directory that another engine filled, whose files
    are then damaged behind its back (half of them)."""
    directory, with_prefix, _, expected = llama
    first = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    check(first, with_prefix[:1], expected)
    core(first).shutdown()
    llm = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL, **engine_args)
    files = block_files(tmp_path)
    assert len(core(llm).scheduler.kv_cache_manager.disk) == len(files) >= 6
    for path in files[: len(files) // 2]:
        damage(path)
    return llm, with_prefix, expected


def _flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 5] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip_a_payload_byte, Path.unlink, lambda path: path.write_bytes(b"x" * 10)],
                         ids=["corrupt", "deleted", "truncated"])
def test_unusable_files_are_recomputed(llama, tmp_path, damage):
    llm, with_prefix, expected = _written_then_damaged(llama, tmp_path, damage)
    check(llm, with_prefix[1:], expected)
    assert disk_stats(llm).load_failures >= 1
    settle(llm)
    layout = core(llm).scheduler.kv_cache_manager.disk.layout
    for block_hash in prompt_block_hashes(with_prefix[1], 8)[:6]:  # the shared prefix, written again intact
        layout.check(block_hash, layout.path_for(block_hash).read_bytes())


def test_unusable_files_fail_the_request_when_asked(llama, tmp_path):
    llm, with_prefix, expected = _written_then_damaged(llama, tmp_path, _flip_a_payload_byte,
                                                       kv_load_failure_policy="fail")
    failed, = generate(llm, with_prefix[1:2])
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "KV blocks could not be loaded (kv_load_failure_policy 'fail')" in failed.error
    settle(llm)
    check(llm, with_prefix[2:], expected)  # the damaged blocks are forgotten: recomputed, not failed again


def test_files_another_replica_deleted_are_misses_even_under_fail(llama, tmp_path):
    """Replicas sharing a directory each evict within their own bound, deleting
    files the others still list: routine, not a fault. Under "fail" such a
    request ended in an error (a 500); a missing file is a cache miss."""
    llm, with_prefix, expected = _written_then_damaged(llama, tmp_path, Path.unlink, kv_load_failure_policy="fail")
    check(llm, with_prefix[1:], expected)
    assert disk_stats(llm).load_failures >= 1
    settle(llm)


def test_an_abort_while_loading_frees_everything(llama, tmp_path):
    directory, with_prefix, _, expected = llama
    first = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    check(first, with_prefix[:1], expected)
    core(first).shutdown()
    second = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)  # held: a dropped LLM shuts its core down
    engine = core(second)
    engine.add_request(EngineCoreRequest("r", with_prefix[1], GREEDY, (), NEW_TOKENS, time.time()))
    engine.step()  # the request starts loading
    assert engine.scheduler.loading["r"].status == RequestStatus.WAITING_FOR_KV
    assert [o.finish_reason for o in engine.abort_requests(["r"])] == ["abort"]
    assert engine.has_unfinished_requests()  # until the worker is done with the blocks
    while engine.has_unfinished_requests():
        engine.step()
    manager = engine.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def test_the_tier_keeps_to_its_size(llama, tmp_path):
    directory, with_prefix, fillers, expected = llama
    llm = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    file_bytes = core(llm).scheduler.kv_cache_manager.disk.layout.file_bytes
    small = LLM(directory, kv_offloading_dir=str(tmp_path / "small"), kv_offloading_dir_size=8 * file_bytes / (1 << 30),
                **POOL)
    check(small, with_prefix + fillers, expected)
    settle(small)
    assert disk_stats(small).evicted > 0 and len(block_files(tmp_path / "small")) <= 8
    # restarted with a smaller bound: the files past it went untracked and stayed for ever (replicas sharing a
    # directory added their bound's worth at each start); the oldest go at the first step now
    core(small).shutdown()
    smaller = LLM(directory, kv_offloading_dir=str(tmp_path / "small"),
                  kv_offloading_dir_size=3 * file_bytes / (1 << 30), **POOL)
    check(smaller, with_prefix[:1], expected)
    settle(smaller)
    assert len(block_files(tmp_path / "small")) <= 3


def test_another_layout_gets_its_own_directory(llama, tmp_path, caplog):
    """...and is told of the first's files: outside its bound, no one's to
    delete, they stayed unnoticed (every layout change left a bound's worth)."""
    directory, with_prefix, _, expected = llama
    first = LLM(directory, kv_offloading_dir=str(tmp_path), **POOL)
    check(first, with_prefix[:1], expected)
    core(first).shutdown()
    with caplog.at_level("WARNING", logger="heron.core.kv_disk_index"):
        other = LLM(directory, kv_offloading_dir=str(tmp_path), **{**POOL, "block_size": 16})
    assert len(core(other).scheduler.kv_cache_manager.disk) == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
    assert "also holds 1 other layouts' blocks" in caplog.text


def test_another_draft_model_gets_its_own_directory(llama, tmp_path):
    """A block carries the draft model's caches too: an engine with another
    draft of the same shape shared the files, and its drafts' K/V was another
    model's (acceptance 31/151 where its own gave 66/66)."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, with_prefix, _, expected = llama
    other_draft = tmp_path / "other-draft"
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    model.save_pretrained(other_draft)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(directory) / name).exists():
            (other_draft / name).write_bytes((Path(directory) / name).read_bytes())
    tier = tmp_path / "tier"

    def with_draft(draft: Path | str) -> LLM:
        return LLM(directory, kv_offloading_dir=str(tier), **POOL,
                   speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})

    first = with_draft(directory)
    check(first, with_prefix[:1], expected)
    core(first).shutdown()
    second = with_draft(other_draft)
    assert len(core(second).scheduler.kv_cache_manager.disk) == 0
    assert len([p for p in tier.iterdir() if p.is_dir()]) == 2
