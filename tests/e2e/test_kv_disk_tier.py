"""`heron serve --kv-offloading-dir`: a restarted server answers a long prompt
it saw before its restart from the disk tier (the prompt's blocks are loaded,
not prefilled again), with the same greedy answer, through the official
`openai` client."""

from __future__ import annotations

import httpx
import openai

from tests.e2e.server_process import ServerProcess, wait_for

PROMPT = "The heron waded through the reeds at first light, " * 24  # ~270 tokens: 16 blocks


def ask(server: ServerProcess):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=8,
                                     temperature=0)


def disk_blocks_shown(server: ServerProcess) -> float | None:
    try:
        return server.metric("heron:kv_offload_blocks", tier="disk")
    except AssertionError:  # no series
        return None


def test_a_restarted_server_answers_from_the_disk_tier(tmp_path):
    first = ServerProcess("--kv-offloading-dir", str(tmp_path))
    try:
        before = ask(first)
        assert before.usage.prompt_tokens_details.cached_tokens == 0
        assert first.metric("heron:kv_offload_stored_blocks_total", tier="disk") >= 16
    finally:
        first.stop()  # the engine finishes its writes as it stops
    files = list(tmp_path.rglob("*.kv"))
    assert len(files) >= 16
    second = ServerProcess("--kv-offloading-dir", str(tmp_path))
    try:
        # before its first request, the restarted server shows what its tier holds (no series at all, before)
        wait_for(lambda: disk_blocks_shown(second) == len(files), timeout=10, what="the disk tier's blocks")
        assert second.metric("heron:prompt_tokens_total") == 0
        after = ask(second)
        assert after.choices[0].text == before.choices[0].text
        num_prompt_blocks = (before.usage.prompt_tokens - 1) // 16
        assert after.usage.prompt_tokens_details.cached_tokens == num_prompt_blocks * 16
        assert second.metric("heron:kv_offload_loaded_blocks_total", tier="disk") == num_prompt_blocks
        assert second.metric("heron:kv_offload_hit_tokens_total", tier="disk") == num_prompt_blocks * 16
        assert second.metric("heron:kv_offload_load_failures_total", tier="disk") == 0
        # a reset empties the tier, and its gauge shows it at once (it kept the old figure until the next step)
        assert httpx.post(f"{second.base_url}/reset_prefix_cache", timeout=30).status_code == 200
        wait_for(lambda: disk_blocks_shown(second) == 0, timeout=2, what="the emptied disk tier's gauge")
        assert not list(tmp_path.rglob("*.kv"))
    finally:
        second.stop()
