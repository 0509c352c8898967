"""Every model family of the CPU suite (tests/model/conftest.py), native and
through the transformers fallback, on CUDA: float32 prompt logprobs close to
transformers' own implementation on the same device, and greedy output
token-identical, for ragged prompts with chunked prefill mixed with decodes and
again from prefix-cache hits. On CUDA the native families run heron's fused
Triton kernels and CUDA graphs (RoPE variants, Q/K norms, sliding windows),
the fallback families transformers' modules around heron's Triton attention
(with CUDA graphs too, unless their forward waits for the device).

``HERON_TEST_DEVICE=cpu`` runs the same checks on the CPU (see
test_gpu_features.py) to check the test itself where no GPU is present."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from heron import LLM, SamplingParams
from heron.models.registry import select_implementation
from tests.gpu.conftest import word_tokenizer
from tests.model.conftest import FALLBACK_FAMILIES, FAMILIES, build_tiny_model

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("HERON_TEST_DEVICE", "cuda")
VOCAB = 512
PROMPT_LENGTHS = [5, 17, 33, 40, 1, 70]
NEW_TOKENS = 12
# float32 on both sides; the reductions of heron's kernels and of cuBLAS/eager attention differ in order
LOGPROB_TOLERANCE = 1e-3


def _family_dir(tmp_path_factory, name: str, settings: dict) -> str:
    directory = str(tmp_path_factory.mktemp(f"gpu-{name}"))
    # AutoConfig.for_model mutates the dicts it is given (the RoPE parameters): build from a copy
    family = {**copy.deepcopy(settings), "vocab_size": VOCAB}
    return build_tiny_model(directory, family, word_tokenizer(VOCAB))


def _prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@torch.inference_mode()
def _reference(directory: str, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """transformers on DEVICE: each prompt's log-softmax at every position, and its
    greedy continuation recomputed from scratch at every step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 attn_implementation="eager").to(DEVICE).eval()
    logprobs, continuations = [], []
    for prompt in prompts:
        # no cache: transformers' own caches differ by version (5.17 builds a chunked one for Llama 4 without chunks)
        logits = model(torch.tensor([prompt], device=DEVICE), use_cache=False).logits[0].float()
        logprobs.append(torch.log_softmax(logits[:-1], dim=-1).cpu())
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids], device=DEVICE), use_cache=False).logits[0, -1].argmax()))
        continuations.append(ids[len(prompt):])
    del model
    return logprobs, continuations


def _check_family(directory: str, expected_impl: str) -> None:
    prompts = _prompts()
    try:
        expected_logprobs, expected_tokens = _reference(directory, prompts)
    except ValueError as error:  # transformers 5.17's Llama 4 needs chunked attention
        import transformers

        pytest.skip(f"transformers {transformers.__version__} does not run this config itself: {error}")
    llm = LLM(directory, dtype="float32", device=DEVICE, max_model_len=128, max_num_batched_tokens=24,
              num_kv_blocks=64)
    assert select_implementation(llm.config.model) == expected_impl
    runner = llm.engine.engine_core.model_runner
    if DEVICE == "cuda":
        # a forward that waits for the device (transformers' MoE loops, dynamic RoPE) runs eagerly, and says so
        graphs = runner.decode_graphs is not None
        assert runner.compute_path["decode"] == ("cuda graphs" if graphs else
                                                 "eager (the forward cannot be captured)")
        assert graphs or expected_impl == "transformers"

    scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for prompt, output, expected in zip(prompts, scored, expected_logprobs):
        got = [entry[token].logprob for token, entry in zip(prompt[1:], output.prompt_logprobs[1:])]
        want = [expected[position, token].item() for position, token in enumerate(prompt[1:])]
        assert got == pytest.approx(want, abs=LOGPROB_TOLERANCE)

    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for round_ in range(2):  # the second round starts from prefix-cache hits
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected_tokens, round_
    llm.engine.engine_core.scheduler.kv_cache_manager.check_integrity()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_family_matches_transformers(tmp_path_factory, family):
    _check_family(_family_dir(tmp_path_factory, family, FAMILIES[family]), "native")


@pytest.mark.parametrize("family", list(FALLBACK_FAMILIES))
def test_fallback_family_matches_transformers(tmp_path_factory, family):
    _check_family(_family_dir(tmp_path_factory, family, FALLBACK_FAMILIES[family]), "transformers")
