"""An offline engine shuts down (``LLM.shutdown``, ``with LLM(...)``, its
collection, the interpreter's exit, the end of ``heron generate``): nothing
shut it down. The disk tier lost the writes still queued (a restart found 0-4
of a prompt's 6 blocks), the KV-event and KV-block-server ports stayed bound
(a second LLM on them failed), and a profile shorter than its window was never
written while torch's profiler stayed on for the whole process."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from heron import LLM, SamplingParams
from tests.e2e.server_process import free_port
from tests.model.conftest import random_prompts

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)
PROMPT = random_prompts([97], seed=41)[0]  # six full blocks of 16 tokens


def test_a_dropped_llm_finishes_its_disk_writes_writes_its_profile_and_frees_its_ports(tiny_model_dir, tmp_path):
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    engine_args = dict(dtype="float32", num_kv_blocks=64, kv_offloading_dir=str(tmp_path / "disk"),
                       kv_events_config=events)
    llm = LLM(tiny_model_dir("llama"), profile_dir=str(tmp_path / "profile"), **engine_args)
    llm.generate([{"prompt_token_ids": PROMPT}], ONE_TOKEN, use_tqdm=False)
    del llm
    gc.collect()
    assert len(list((tmp_path / "disk").rglob("*.kv"))) == 6
    assert list((tmp_path / "profile").glob("heron-trace-*.json"))
    assert not torch.autograd.profiler._is_profiler_enabled  # noqa: SLF001 (torch's own flag)
    with LLM(tiny_model_dir("llama"), **engine_args) as again:  # binds the same ports
        [output] = again.generate([{"prompt_token_ids": PROMPT}], ONE_TOKEN, use_tqdm=False)
        assert output.num_cached_tokens == 96  # every block, from the disk
    again.shutdown()  # a second time does nothing
    with pytest.raises(RuntimeError, match="has been shut down"):  # its disk writer is gone: it would hang
        again.generate([{"prompt_token_ids": PROMPT}], ONE_TOKEN, use_tqdm=False)


def test_heron_generate_leaves_the_prompts_blocks_on_disk(tiny_model_dir, tmp_path):
    disk = tmp_path / "disk"
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    generate = subprocess.run([sys.executable, "-m", "heron.entrypoints.cli", "--log-level", "WARNING", "generate",
                               prompt, "--model", tiny_model_dir("llama"), "--max-tokens", "1", "--num-kv-blocks",
                               "64", "--kv-offloading-dir", str(disk)], capture_output=True, text=True, timeout=300)
    assert generate.returncode == 0, generate.stderr
    with LLM(tiny_model_dir("llama"), num_kv_blocks=64) as llm:
        num_tokens = len(llm.get_tokenizer().encode(prompt))
    assert len(list(disk.rglob("*.kv"))) == num_tokens // 16
