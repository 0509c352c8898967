import json

import pytest

from heron.benchmarks.datasets import prefix_repetition_dataset, random_dataset, sharegpt_dataset
from heron.benchmarks.endpoint_client import RequestResult
from heron.benchmarks.metrics import compute_metrics, parse_goodput


def test_random_prompts_have_exact_token_lengths(embedded_tokenizer):
    samples = random_dataset(embedded_tokenizer, num_prompts=20, input_len=100, output_len=32, range_ratio=0.5, seed=3)
    lengths = {s.prompt_len for s in samples}
    assert len(lengths) > 5 and min(lengths) >= 50 and max(lengths) <= 150
    for sample in samples:
        assert len(embedded_tokenizer.encode(sample.prompt, add_special_tokens=False)) == sample.prompt_len
        assert 16 <= sample.expected_output_len <= 48
    again = random_dataset(embedded_tokenizer, num_prompts=20, input_len=100, output_len=32, range_ratio=0.5, seed=3)
    assert [s.prompt for s in again] == [s.prompt for s in samples]


def test_random_prompts_from_a_word_level_tokenizer():
    """The GPU benchmarks' random-weight models use a word-level vocabulary
    ("w3".."wN", no "Ġ" marker): its plain words build the prompts."""
    from tests.gpu.conftest import word_tokenizer

    tokenizer = word_tokenizer(512)
    samples = random_dataset(tokenizer, num_prompts=6, input_len=40, output_len=8, range_ratio=0.5, seed=2)
    for sample in samples:
        ids = tokenizer.encode(sample.prompt, add_special_tokens=False)
        assert len(ids) == sample.prompt_len and 20 <= sample.prompt_len <= 60
        assert not set(ids) & {0, 1, 2}  # never the unknown, BOS or EOS token


def test_random_prefix_and_prefix_repetition_share_prefixes(embedded_tokenizer):
    samples = random_dataset(embedded_tokenizer, 5, 20, 8, prefix_len=40, seed=1)
    prefix_tokens = [embedded_tokenizer.encode(s.prompt, add_special_tokens=False)[:40] for s in samples]
    assert all(p == prefix_tokens[0] for p in prefix_tokens)
    assert all(len(embedded_tokenizer.encode(s.prompt, add_special_tokens=False)) == s.prompt_len == 60
               for s in samples)
    repeated = prefix_repetition_dataset(embedded_tokenizer, num_prompts=12, prefix_len=64, suffix_len=16,
                                         num_prefixes=3, output_len=10, seed=2)
    heads = {tuple(embedded_tokenizer.encode(s.prompt, add_special_tokens=False)[:64]) for s in repeated}
    assert len(heads) == 3
    for sample in repeated:
        assert sample.prompt_len == len(embedded_tokenizer.encode(sample.prompt, add_special_tokens=False)) == 80
        assert sample.expected_output_len == 10


def test_sharegpt_file(tmp_path, embedded_tokenizer):
    data = [{"conversations": [{"from": "human", "value": f"Question {i}: why is the sky blue?"},
                               {"from": "gpt", "value": "Because of Rayleigh scattering of sunlight in air."}]}
            for i in range(5)] + [{"conversations": [{"from": "human", "value": "hi"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    samples = sharegpt_dataset(embedded_tokenizer, str(path), num_prompts=4)
    assert len(samples) == 4 and all(s.prompt.startswith("Question") for s in samples)
    expected = len(embedded_tokenizer.encode("Because of Rayleigh scattering of sunlight in air.",
                                             add_special_tokens=False))
    assert all(s.expected_output_len == expected for s in samples)
    with pytest.raises(ValueError, match="only 5 usable"):
        sharegpt_dataset(embedded_tokenizer, str(path), num_prompts=9)


def test_metrics_and_goodput():
    assert parse_goodput(["ttft:200", "tpot:20", "e2e:1000"]) == {"ttft": 200.0, "tpot": 20.0, "e2el": 1000.0}
    with pytest.raises(ValueError):
        parse_goodput(["speed:3"])
    fast = RequestResult(success=True, prompt_len=10, output_tokens=11, ttft=0.1, itl=[0.01] * 10, latency=0.2)
    slow = RequestResult(success=True, prompt_len=10, output_tokens=11, ttft=0.5, itl=[0.05] * 10, latency=1.0)
    failed = RequestResult(success=False, error="boom")
    metrics = compute_metrics([fast, slow, failed], duration_s=2.0, goodput_slos={"ttft": 300}, percentiles=[50, 99])
    assert metrics["completed"] == 2 and metrics["failed"] == 1
    assert metrics["request_goodput"] == 0.5 and metrics["output_throughput"] == 11.0
    assert metrics["mean_ttft_ms"] == pytest.approx(300.0) and metrics["median_tpot_ms"] == pytest.approx(30.0)
    assert metrics["p99_itl_ms"] == pytest.approx(50.0)
