"""Speculative decoding without a model: the n-gram proposer, the rejection
sampler (greedy exactness, and a statistical test that the emitted tokens follow
the target distribution for certain n-gram drafts and for draft-model drafts),
and the scheduler's accounting of drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heron.config import SpeculativeConfig
from heron.sample.metadata import SamplingMetadata
from heron.sample.rejection import RejectionSampler
from heron.spec_decode.ngram import NgramProposer
from heron.step_outputs import ModelRunnerOutput
from tests.helpers import make_request
from tests.unit.test_scheduler import add, make_scheduler


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.propose(np.array([1, 2, 3, 4, 5, 1, 2, 3])) == [4, 5, 1]
    # [9, 1] never recurs; [1] does, latest at index 4 -> what followed it
    assert proposer.propose(np.array([1, 5, 6, 7, 1, 8, 9, 9, 1])) == [8, 9, 9]
    # the longest n wins over a later shorter match
    assert proposer.propose(np.array([4, 5, 6, 0, 0, 5, 7, 7, 4, 5])) == [6, 0, 0]
    assert proposer.propose(np.array([1, 2, 3, 4])) == []
    assert proposer.propose(np.array([1, 2, 1]), max_drafts=1) == [2]
    short = NgramProposer(2, prompt_lookup_min=2, prompt_lookup_max=2)
    assert short.propose(np.array([3, 1, 9, 9, 1])) == []  # a 1-gram match is too short


def test_ngram_drafts_a_whole_k_in_a_loop():
    """In a loop the latest match runs into the end: cut there, a loop of one
    token drafted one token a step (twice the steps of vLLM's k)."""
    proposer = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.propose(np.array([7, 5, 5, 5, 5])) == [5, 5, 5, 5]
    assert proposer.propose(np.array([9, 1, 2, 1, 2, 1, 2])) == [1, 2, 1, 2]
    assert proposer.propose(np.array([9, 1, 2, 1, 2, 1, 2]), max_drafts=3) == [1, 2, 1]


def test_one_prompt_lookup_bound_given_is_both_as_in_vllm():
    """{"prompt_lookup_min": 5} met the default max of 4 and was refused."""
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5})
    assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"method": "beam", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "prompt_lookup"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
        # each of these used to start a server whose engine died at the first request, or gave a TypeError traceback
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2.5}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": "2"}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": None}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 10**6}, r"\[1, 32\]"),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": 5}, "model must be a path"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "/some/draft"}, "for method 'draft_model'"),
    ],
)
def test_bad_speculative_configs_name_the_problem(config, fragment):
    with pytest.raises(ValueError, match=fragment):
        SpeculativeConfig.from_dict(config)


def greedy_metadata(rows: int) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.zeros(0), all_greedy=True, all_random=False)


def test_greedy_accepts_the_drafts_that_match_the_argmax():
    vocab = 8
    # request 0: argmax per row 3, 5, 6 ; drafts [3, 4] -> accept 3, reject 4 -> emit 5
    # request 1: argmax 1, 2, 7 ; drafts [1, 2] -> all accepted + bonus 7
    argmax = [3, 5, 6, 1, 2, 7]
    logits = torch.full((6, vocab), -1.0)
    logits[torch.arange(6), torch.tensor(argmax)] = 1.0
    result = RejectionSampler()(logits, greedy_metadata(6), [[3, 4], [1, 2]])
    assert result.token_ids == [[3, 5], [1, 2, 7]]
    assert result.rows == [[0, 1], [3, 4, 5]]


def random_metadata(rows: int) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.ones(rows), all_greedy=False, all_random=True)


def _frequencies(tokens: list[int], vocab: int) -> np.ndarray:
    return np.bincount(np.asarray(tokens), minlength=vocab) / max(len(tokens), 1)


def _assert_close(observed: np.ndarray, expected: np.ndarray, count: int) -> None:
    sigma = np.sqrt(expected * (1 - expected) / count)
    assert np.all(np.abs(observed - expected) <= 5 * sigma + 1e-3), (observed, expected)


@pytest.mark.parametrize("draft_model", [False, True])
def test_sampled_tokens_follow_the_target_distribution(draft_model):
    """Many copies of one request with 2 drafts: the first emitted token is
    distributed as p_0, and the second (present when the first draft was
    accepted) as p_1, whatever the drafts."""
    torch.manual_seed(0)
    vocab, copies = 6, 40000
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                      [0.05, 0.50, 0.05, 0.30, 0.05, 0.05],
                      [0.10, 0.10, 0.40, 0.10, 0.20, 0.10]])
    logits = p.log().repeat(copies, 1)
    if draft_model:
        q = torch.tensor([[0.10, 0.60, 0.10, 0.10, 0.05, 0.05],
                          [0.30, 0.20, 0.20, 0.10, 0.10, 0.10]])
        generator = torch.Generator().manual_seed(1)
        first = torch.multinomial(q[0], copies, replacement=True, generator=generator)
        second = torch.multinomial(q[1], copies, replacement=True, generator=generator)
        drafts = torch.stack([first, second], dim=1).tolist()
        draft_probs = q.repeat(copies, 1)
    else:
        drafts = [[1, 3]] * copies  # certain drafts: q is one-hot at the draft
        draft_probs = None
    sampler = RejectionSampler(torch.Generator().manual_seed(2))
    result = sampler(logits, random_metadata(len(logits)), drafts, draft_probs)
    first_tokens = [tokens[0] for tokens in result.token_ids]
    _assert_close(_frequencies(first_tokens, vocab), p[0].numpy(), copies)
    # given the first draft was accepted, the second emitted token follows p_1
    second_tokens = [tokens[1] for tokens, ds in zip(result.token_ids, drafts) if len(tokens) > 1]
    assert len(second_tokens) > 1000
    _assert_close(_frequencies(second_tokens, vocab), p[1].numpy(), len(second_tokens))
    accepted = sum(len(tokens) - 1 for tokens in result.token_ids)
    assert 0 < accepted < 2 * copies


def test_scheduler_grants_drafts_rolls_back_rejections_and_counts():
    scheduler = make_scheduler(block_size=4)
    request = make_request(6, max_tokens=10)
    add(scheduler, request)
    out = scheduler.schedule()
    scheduler.update_from_output(
        out, ModelRunnerOutput([request.request_id], [[7]], draft_token_ids={request.request_id: [8, 9, 10]})
    )
    assert request.spec_token_ids == [8, 9, 10]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {request.request_id: 4}  # the last token + 3 drafts
    assert out.scheduled_spec_decode_tokens == {request.request_id: [8, 9, 10]}
    assert request.num_computed_tokens == 10
    # the first draft is accepted, the second rejected (the target said 4)
    scheduler.update_from_output(out, ModelRunnerOutput([request.request_id], [[8, 4]], draft_token_ids={}))
    assert request.output_token_ids == [7, 8, 4] and request.num_computed_tokens == 8
    assert request.spec_token_ids == []
    stats = scheduler.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 3, 1)
    scheduler.kv_cache_manager.check_integrity()


def test_drafts_never_run_past_max_tokens():
    scheduler = make_scheduler()
    request = make_request(5, max_tokens=3)
    add(scheduler, request)
    out = scheduler.schedule()
    scheduler.update_from_output(
        out, ModelRunnerOutput([request.request_id], [[7]], draft_token_ids={request.request_id: [1, 2, 3, 4]})
    )
    assert request.spec_token_ids == [1]  # 2 tokens left: 1 draft + the target's token
