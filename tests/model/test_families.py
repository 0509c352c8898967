"""Each supported family against transformers' own implementation, same random
weights, float32: logprobs close at every prompt position, greedy tokens
identical, for ragged prompts batched together with chunked prefill."""

from __future__ import annotations

import pytest
import torch

from heron import LLM, SamplingParams
from heron.models.registry import select_implementation
from tests.model.conftest import (
    FALLBACK_FAMILIES,
    FAMILIES,
    load_reference,
    random_prompts,
    reference_greedy,
    reference_logprobs,
)

PROMPT_LENGTHS = [5, 17, 33, 40, 1]
NEW_TOKENS = 12


def make_llm(directory: str) -> LLM:
    # a 24-token budget chunks every prompt longer than that and mixes chunks with decodes
    return LLM(directory, dtype="float32", max_model_len=128, max_num_batched_tokens=24, num_kv_blocks=64)


def check_against_reference(directory: str, expected_impl: str) -> None:
    llm = make_llm(directory)
    assert select_implementation(llm.config.model) == expected_impl
    reference = load_reference(directory)
    prompts = random_prompts(PROMPT_LENGTHS)

    # logits: prompt logprobs of every position, chosen token and top-5, vs transformers
    scored = llm.generate(prompts[:4], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    for prompt, output in zip(prompts, scored):
        expected = reference_logprobs(reference, prompt)
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        for position, entry in enumerate(output.prompt_logprobs[1:]):
            target = prompt[position + 1]
            assert entry[target].logprob == pytest.approx(expected[position, target].item(), abs=2e-4)
            top_values, top_ids = expected[position].topk(5)
            got = sorted((lp.logprob for tid, lp in entry.items() if lp.rank <= 5), reverse=True)
            assert got == pytest.approx(top_values.tolist(), abs=2e-4)

    # greedy: all prompts at once, chunked and mixed with decodes
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == reference_greedy(reference, prompt, NEW_TOKENS)
    llm.engine.engine_core.scheduler.kv_cache_manager.check_integrity()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_family_matches_transformers(tiny_model_dir, family):
    check_against_reference(tiny_model_dir(family), "native")


@pytest.mark.parametrize("family", list(FALLBACK_FAMILIES))
def test_transformers_fallback_matches_transformers(tiny_model_dir, family):
    check_against_reference(tiny_model_dir(family), "transformers")


def _greedy_with_logprobs(outputs) -> list[tuple[list[int], list[float]]]:
    return [(list(completion.token_ids), [entry[token].logprob for token, entry in
                                          zip(completion.token_ids, completion.logprobs)])
            for completion in (output.outputs[0] for output in outputs)]


def test_longrope_takes_one_set_of_factors_whatever_a_request_is_batched_with(tiny_model_dir):
    """transformers picks LongRoPE's short or long factors per forward call, by
    its largest position; heron's call is a step's whole batch, so a request's
    answer depended on its neighbours, its prefill's chunks and its cached
    prefix. The factors are now fixed: long when max_model_len exceeds the
    original context (16 here), as vLLM does, else short."""
    directory = tiny_model_dir("phi3-longrope")
    reference = load_reference(directory)
    short, long_one, long_two = random_prompts([6, 20, 40], seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    llm = LLM(directory, dtype="float32", max_model_len=128, num_kv_blocks=64)
    [alone] = _greedy_with_logprobs(llm.generate([short], params, use_tqdm=False))
    together = _greedy_with_logprobs(llm.generate([short, long_one, long_two], params, use_tqdm=False))
    assert together[0][0] == alone[0] and together[0][1] == pytest.approx(alone[1], abs=1e-5)
    for prompt, (tokens, _) in zip([long_one, long_two], together[1:]):  # past 16: transformers' long factors too
        assert tokens == reference_greedy(reference, prompt, 8)

    # chunks of 8 and a cached 24-token prefix: the first positions were rotated with the short factors
    chunked = LLM(directory, dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=8,
                  block_size=8)
    chunked.generate([long_two[:24]], params, use_tqdm=False)
    [output] = chunked.generate([long_two], params, use_tqdm=False)
    assert output.num_cached_tokens == 24
    [(tokens, logprobs)] = _greedy_with_logprobs([output])
    assert tokens == together[2][0] and logprobs == pytest.approx(together[2][1], abs=1e-4)

    # within the original context: the short factors, as transformers uses for a sequence that short
    short_context = LLM(directory, dtype="float32", max_model_len=16, num_kv_blocks=16)
    [(tokens, _)] = _greedy_with_logprobs(short_context.generate([short], params, use_tqdm=False))
    assert tokens == reference_greedy(reference, short, 8)


def test_native_model_can_be_forced_through_transformers(tiny_model_dir):
    directory = tiny_model_dir("qwen2")
    llm = LLM(directory, dtype="float32", max_model_len=128, num_kv_blocks=32, model_impl="transformers")
    assert select_implementation(llm.config.model) == "transformers"
    prompts = random_prompts([9, 20], seed=3)
    reference = load_reference(directory)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 8)


def test_bfloat16_runs_and_agrees_on_first_tokens(tiny_model_dir):
    directory = tiny_model_dir("llama")
    llm = LLM(directory, dtype="bfloat16", max_model_len=128, num_kv_blocks=32)
    assert llm.config.model.dtype == torch.bfloat16
    reference = load_reference(directory)
    prompt = random_prompts([12], seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids[0] == reference_greedy(reference, prompt, 1)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_are_reported_once_through_preemptions(tiny_model_dir, async_scheduling):
    """A pool too small for both requests preempts them over and over; each
    recompute scores the prompt again, and those scores were reported again (a
    40-token prompt came back with 355 entries). Each prompt position once, and
    the same values as in a run without preemption."""
    directory = tiny_model_dir("llama")
    prompts = random_prompts([40, 40], seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1)
    tight = LLM(directory, dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96,
                max_num_batched_tokens=24, async_scheduling=async_scheduling)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.engine_core.scheduler.num_preemptions > 0
    roomy = LLM(directory, dtype="float32", block_size=8, max_model_len=96, max_num_batched_tokens=24)
    expected = roomy.generate(prompts[:1], params, use_tqdm=False)[0]
    for prompt, output in zip(prompts, outputs):
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    for got, want in zip(outputs[0].prompt_logprobs[1:], expected.prompt_logprobs[1:]):
        assert {token: lp.logprob for token, lp in got.items()} == pytest.approx(
            {token: lp.logprob for token, lp in want.items()}, abs=1e-5)


def test_a_sharded_checkpoint_loads_and_a_missing_shard_is_named_before_loading(tiny_model_dir, tmp_path):
    """A checkpoint saved in several shards (model.safetensors.index.json) gives
    the same greedy tokens as the single file; one with a shard missing (a partial
    download) fails at once, naming it."""
    import shutil

    from transformers import AutoModelForCausalLM

    single = tiny_model_dir("llama")
    sharded = str(tmp_path / "sharded")
    shutil.copytree(single, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(path.name for path in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    prompts = random_prompts([9, 23])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(directory: str) -> list[list[int]]:
        llm = LLM(directory, dtype="float32", max_model_len=64, num_kv_blocks=16)
        return [output.outputs[0].token_ids for output in llm.generate(prompts, greedy, use_tqdm=False)]

    assert tokens(sharded) == tokens(single)
    (tmp_path / "sharded" / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"1 of them are missing \\({shards[1]}\\)"):
        LLM(sharded, dtype="float32", max_model_len=64, num_kv_blocks=16)
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="is not a readable safetensors index"):  # was KeyError: 'weight_map'
        LLM(sharded, dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_a_truncated_safetensors_file_is_named(tiny_model_dir, tmp_path):
    """A partial download: the traceback said "incomplete metadata" and named no file."""
    import shutil

    directory = tmp_path / "cut"
    shutil.copytree(tiny_model_dir("llama"), directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file"):
        LLM(str(directory), dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_the_tokenizer_comes_from_where_tokenizer_says(tiny_model_dir, tmp_path, monkeypatch):
    """--tokenizer takes what --model takes (a GGUF file, a directory, "~"); a
    directory without tokenizer files says so. Each was an OSError traceback from
    transformers ("Repo id must use alphanumeric chars", "sentencepiece or tiktoken")."""
    import shutil

    from heron.loader.model_source import ModelNotFoundError, default_model_path

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir("llama"), bare, ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*it has none of tokenizer.json"):
        LLM(str(bare), dtype="float32", max_model_len=64, num_kv_blocks=16)
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_model_dir("llama"), tmp_path / "tok", ignore=shutil.ignore_patterns("*.safetensors"))
    for tokenizer in ("~/tok", default_model_path()):
        llm = LLM(str(bare), tokenizer=tokenizer, dtype="float32", max_model_len=64, num_kv_blocks=16)
        assert llm.get_tokenizer().encode("Hello world") == [19556, 905]
    with pytest.raises(ModelNotFoundError, match="tokenizer '/nonexistent/tok' not found"):
        LLM(str(bare), tokenizer="/nonexistent/tok", dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_a_fallback_checkpoint_missing_a_weight_is_refused(tiny_model_dir, tmp_path):
    """transformers fills a missing weight with random values and prints a report:
    the model ran and answered garbage, where a native family refuses the checkpoint."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "phi3"
    shutil.copytree(tiny_model_dir("phi3"), directory)
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 of the model's weights \\(model.layers.1.mlp.down_proj.weight\\)"):
        LLM(str(directory), dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_a_native_checkpoint_missing_weights_names_them_as_the_checkpoint_does(tiny_model_dir, tmp_path):
    """The native loader named heron's fused parameters ("qkv_proj.weight[64:]")
    and no path: a user looking in the checkpoint found no such tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "llama"
    shutil.copytree(tiny_model_dir("llama"), directory)
    weights = load_file(directory / "model.safetensors")
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        del weights[name]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as raised:
        LLM(str(directory), dtype="float32", max_model_len=64, num_kv_blocks=16, model_impl="native")
    message = str(raised.value)
    assert message.startswith(f"{directory}: the checkpoint lacks 2 of the model's weights "
                              "(model.layers.0.self_attn.k_proj.weight, model.layers.1.mlp.up_proj.weight)"), message
