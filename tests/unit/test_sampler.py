import math

import pytest
import torch

from heron.core.scheduler_output import NewRequestData
from heron.sample.ops import apply_penalties
from heron.sample.sampler import Sampler
from heron.sample.top_k_top_p import _sorted_top_k_top_p, apply_top_k_top_p
from heron.sampling_params import SamplingParams
from heron.worker.request_state import CachedRequestState
from heron.worker.sampling_metadata import build_sampling_metadata

VOCAB = 8


def state(params: SamplingParams, prompt=(1, 2, 3), output=(), request_id="r") -> CachedRequestState:
    data = NewRequestData(
        request_id=request_id,
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        sampling_params=params,
        eos_token_ids=frozenset({7}),
        block_ids=[0],
        num_computed_tokens=0,
    )
    return CachedRequestState.from_new_request(data, torch.device("cpu"))


def sample(logits, states, generator_seed=0):
    metadata = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    generator = torch.Generator().manual_seed(generator_seed)
    return Sampler(generator)(torch.tensor(logits, dtype=torch.float32), metadata)


def test_greedy_takes_the_argmax_and_logit_bias_can_flip_it():
    logits = [[0.0, 3.0, 1.0, 0, 0, 0, 0, 0]]
    assert sample(logits, [state(SamplingParams(temperature=0))]).sampled_token_ids.tolist() == [1]
    biased = state(SamplingParams(temperature=0, logit_bias={2: 5.0}))
    assert sample(logits, [biased]).sampled_token_ids.tolist() == [2]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = [[0.0, 0, 0, 0, 0, 4.0, 0, 5.0]]  # 7 is EOS, 5 a stop id
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sample(logits, [state(params, output=(3,))]).sampled_token_ids.tolist() == [0]
    assert sample(logits, [state(params, output=(3, 3))]).sampled_token_ids.tolist() == [7]


def test_top_k_one_and_tiny_top_p_are_greedy_even_when_hot():
    logits = [[0.0, 1.0, 2.5, 2.4, 0, 0, 0, 0]] * 2
    states = [
        state(SamplingParams(temperature=5.0, top_k=1), request_id="a"),
        state(SamplingParams(temperature=5.0, top_p=0.01), request_id="b"),
    ]
    for seed in range(20):
        assert sample(logits, states, seed).sampled_token_ids.tolist() == [2, 2]


def test_top_k_top_p_masks():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    kept = apply_top_k_top_p(logits.clone(), torch.tensor([2, 4]), None)
    assert torch.isinf(kept[0]).tolist() == [True, False, False, True]
    assert not torch.isinf(kept[1]).any()
    probs = torch.softmax(logits[0], -1)  # ~[0.03, 0.64, 0.24, 0.09]
    kept = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.7, 0.95]))
    assert torch.isinf(kept[0]).tolist() == [True, False, False, True]
    assert probs[1] + probs[2] >= 0.7
    assert torch.isinf(kept[1]).tolist() == [True, False, False, False]
    both = apply_top_k_top_p(logits.clone(), torch.tensor([1, 4]), torch.tensor([0.99, 0.5]))
    assert torch.isinf(both[0]).tolist() == [True, False, True, True]
    assert torch.isinf(both[1]).tolist() == [True, False, True, True]


def test_top_k_candidates_match_the_full_sort():
    """Rows that all use top-k work on their candidates (no vocabulary sort, no
    host read of top_k): the same masks as sorting the whole vocabulary."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(6, 3000, generator=generator) * 3
        top_k = torch.randint(1, 200, (6,), generator=generator)
        top_p = torch.rand(6, generator=generator) * 0.9 + 0.05
        for p in (None, top_p):
            candidates = apply_top_k_top_p(logits, top_k, p, max_top_k=int(top_k.max()))
            full_sort = apply_top_k_top_p(logits, top_k, p, max_top_k=logits.shape[1])
            assert torch.equal(torch.isinf(candidates), torch.isinf(full_sort))
            assert torch.equal(candidates[~torch.isinf(candidates)], logits[~torch.isinf(candidates)])


def test_top_p_alone_through_candidates_matches_the_sort():
    """Top-p alone on the CPU cuts among each row's 1,024 largest logits, and
    sorts only a row whose candidates hold less than top_p: a flat row (its
    cut-off lies past 1,024 tokens) batched with peaked ones."""
    generator = torch.Generator().manual_seed(1)
    for trial in range(10):
        logits = torch.randn(5, 5000, generator=generator) * (0.5 + trial)
        logits[0] = torch.rand(5000, generator=generator) * 0.01  # flat: needs most of the vocabulary
        top_p = torch.rand(5, generator=generator) * 0.9 + 0.05
        top_p[1] = 1.0
        through_candidates = apply_top_k_top_p(logits, None, top_p)
        sorted_path = _sorted_top_k_top_p(logits, None, top_p)
        assert torch.equal(torch.isinf(through_candidates), torch.isinf(sorted_path)), trial
        assert torch.isinf(through_candidates[0]).sum() > 0 and torch.isfinite(through_candidates[1]).all()


def test_the_sort_and_the_candidates_agree_at_a_close_top_p_cut_off():
    """A bfloat16-valued row whose mass before its 70th token is 0.94999103:
    the sort's float32 softmax and cumulative sum made it 0.95000327 and cut
    four tokens the candidates kept, so a seeded top_p 0.95 request drew
    another token beside a top_k request (which sends the batch to the sort)."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(4):
        logits = (torch.randn(64, 49152, generator=generator) * 5).to(torch.bfloat16).float()
    row, top_p = logits[21:22], torch.tensor([0.95])
    through_candidates = apply_top_k_top_p(row, None, top_p)
    assert torch.isfinite(through_candidates).sum() == 73
    assert torch.equal(torch.isinf(through_candidates), torch.isinf(_sorted_top_k_top_p(row, None, top_p)))


def test_every_logit_tied_with_the_top_p_cut_off_stays_on_every_path():
    """Two tied logits where top-p 0.3 needs one of them: which one a sort
    ordered first decided which token a row could draw. Every path (top-k's
    candidates, top-p's candidates, the sort) keeps both."""
    row = torch.tensor([[4.0, 1.0, 4.0] + [-20.0] * 2000])
    top_p = torch.tensor([0.3])
    paths = {
        "top-k candidates": apply_top_k_top_p(row, torch.tensor([3]), top_p, max_top_k=3),
        "top-p candidates": apply_top_k_top_p(row, None, top_p),
        "sort": _sorted_top_k_top_p(row, None, top_p),
        "sort with top-k": _sorted_top_k_top_p(row, torch.tensor([3]), top_p),
    }
    for name, kept in paths.items():
        assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == [0, 2], name


def test_min_p_drops_unlikely_tokens():
    logits = [[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05), -1e9, -1e9, -1e9, -1e9]]
    params = SamplingParams(temperature=1.0, min_p=0.5)  # threshold 0.25
    seen = {sample(logits, [state(params)], seed).sampled_token_ids.item() for seed in range(200)}
    assert seen == {0, 1}


def test_penalties_follow_vllm_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    out = apply_penalties(
        logits.clone(), [[0, 0, 3]], [[1]],
        presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]), repetition=torch.tensor([2.0]),
    )
    # token 0: seen -> 2/2 = 1, then -2*0.25 -0.5 = 0.0; token 1 (prompt): -2*2 = -4
    # token 2: unseen -> 1; token 3: 1/2 = 0.5 - 0.25 - 0.5 = -0.25
    assert out.tolist() == [[0.0, -4.0, 1.0, -0.25]]


def test_seeded_request_samples_the_same_whatever_the_batch():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)).tolist()
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = sample([logits[0]], [state(seeded, request_id="s")], generator_seed=0)
    batched = sample(
        [logits[2], logits[0], logits[1]],
        [state(SamplingParams(temperature=1.0), request_id="x"), state(seeded, request_id="s"),
         state(SamplingParams(temperature=0.7), request_id="y")],
        generator_seed=99,
    )
    assert batched.sampled_token_ids[1] == alone.sampled_token_ids[0]
    # different output positions draw different noise
    draws = {sample([logits[0]], [state(seeded, output=(1,) * k)]).sampled_token_ids.item() for k in range(30)}
    assert len(draws) > 1


def test_sampling_matches_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0, 0, 0, 0])
    logits = [torch.log(probs).tolist()] * 4000
    params = SamplingParams(temperature=1.0)
    states = [state(params, request_id=str(i)) for i in range(4000)]
    counts = torch.bincount(sample(logits, states).sampled_token_ids, minlength=VOCAB).float()
    expected = probs * 4000
    chi2 = (((counts[:4] - expected[:4]) ** 2) / expected[:4]).sum().item()
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom
    assert counts[4:].sum() == 0


def test_a_token_of_negligible_probability_is_not_drawn():
    """The CPU's uniform noise is a multiple of 2^-24: -log(1 - U) made U = 0 an
    E of 0 (clamped to the float's tiny), and its token won whatever its
    probability, in 0.3% of draws over a 49,152-token vocabulary. One token
    holds all but 5e-8 of the mass here; 5,000 draws took another about 14 times."""
    from heron.sample.ops import sample_from_probs

    probs = torch.full((500, 49152), 1e-12)
    probs[:, 7] = 1.0 - 49151e-12
    generator = torch.Generator().manual_seed(0)
    others = sum(int((sample_from_probs(probs, {}, generator) != 7).sum()) for _ in range(10))
    assert others <= 1
    # a row of one possible token draws it even where its noise is the largest
    only = torch.zeros(1, 8)
    only[0, 3] = 1.0
    assert all(sample_from_probs(only, {}, generator).item() == 3 for _ in range(200))


def test_logprobs_are_raw_with_ranks_and_top_entries():
    logits = [[0.0, 3.0, 1.0, 2.0, 0, 0, 0, 0]]
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={2: 10.0})
    out = sample(logits, [state(params)])
    raw = torch.log_softmax(torch.tensor(logits[0]), -1)
    assert out.sampled_token_ids.tolist() == [2]
    assert out.logprob_token_ids.tolist() == [[2, 1, 3]]
    assert out.logprobs[0].tolist() == pytest.approx([raw[2].item(), raw[1].item(), raw[3].item()])
    assert out.sampled_ranks.tolist() == [3]


def metadata_fields(metadata) -> dict:
    """Comparable values of every SamplingMetadata field (tensors as lists)."""
    import dataclasses

    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, tuple):
            return tuple(plain(v) for v in value)
        if isinstance(value, dict):
            return {k: v.initial_seed() for k, v in value.items()}
        return value

    return {f.name: plain(getattr(metadata, f.name)) for f in dataclasses.fields(metadata)}


def test_the_metadata_builder_keeps_the_parameters_part_and_redoes_what_changes_per_step():
    from heron.worker.sampling_metadata import SamplingMetadataBuilder

    cpu = torch.device("cpu")
    mixes = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=3, top_p=0.9, seed=7),
        SamplingParams(temperature=1.0, min_p=0.1, logit_bias={2: 1.5}, logprobs=2),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5]),
        SamplingParams(temperature=0.5, presence_penalty=0.5, repetition_penalty=1.2),
    ]
    builder = SamplingMetadataBuilder(VOCAB, cpu)
    states = [state(p, request_id=f"r{i}") for i, p in enumerate(mixes)]
    first = builder.build(states)
    for step in range(3):  # decode steps: outputs grow, the rows stay
        for s in states:
            s.token_ids.append(3)
        metadata = builder.build(states)
        assert metadata.temperature is first.temperature and metadata.top_k is first.top_k  # kept
        assert metadata.presence_penalties is first.presence_penalties is not None
        assert metadata_fields(metadata) == metadata_fields(build_sampling_metadata(states, VOCAB, cpu))
        assert (metadata.banned_tokens is not None) == (step == 0)  # min_tokens=2 reached after step 0
        assert metadata.output_token_ids[4] == [3] * (step + 1)  # penalties see this step's outputs
    # another order, or another request in a row: built anew
    for changed in (states[::-1], states[:2] + [state(SamplingParams(temperature=0.3), request_id="n")] + states[3:]):
        kept = builder.build(states).temperature
        assert builder.build(states).temperature is kept
        metadata = builder.build(changed)
        assert metadata.temperature is not kept
        assert metadata_fields(metadata) == metadata_fields(build_sampling_metadata(changed, VOCAB, cpu))


def test_a_row_at_top_p_1_keeps_its_whole_distribution_beside_a_top_p_row():
    """A row with the default top_p batched with a top_p 0.9 row: its float32
    cumulative sums reached 1.0 before the tail, which was masked (a seeded
    request's tokens then depended on its batch)."""
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 3
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0, 0.9]))
    assert torch.isfinite(masked[0]).all() and not torch.isfinite(masked[1]).all()


def test_a_seeded_top_k_row_draws_the_same_tokens_whatever_its_batch():
    """top_k = 2 over logits whose 2nd and 3rd tie (bfloat16 logits on a GPU tie
    often): alone, the candidate path kept exactly two; beside a row without
    top_k, the sorted path kept the tie too, and 39 of 200 seeds drew another
    token. Both now keep every logit tied with the k-th."""
    row = torch.tensor([5.0, 4.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0])

    def request(params: SamplingParams, request_id: str) -> CachedRequestState:
        generator = torch.Generator() if params.seed is not None else None
        return CachedRequestState(request_id, [1, 2, 3], 3, params, frozenset({0}), [], 3, generator)

    drawn = set()
    for seed in range(100):
        seeded = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        alone = Sampler(torch.Generator().manual_seed(0))(
            row[None].clone(), build_sampling_metadata([request(seeded, "a")], 8, torch.device("cpu")))
        beside = Sampler(torch.Generator().manual_seed(0))(
            torch.stack([row, row]),
            build_sampling_metadata([request(seeded, "a"), request(SamplingParams(temperature=1.0), "b")], 8,
                                    torch.device("cpu")))
        assert alone.sampled_token_ids[0].item() == beside.sampled_token_ids[0].item(), seed
        drawn.add(alone.sampled_token_ids[0].item())
    assert drawn == {0, 1, 2}
