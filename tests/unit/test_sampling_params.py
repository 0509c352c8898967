import pytest

from heron.sampling_params import SamplingParamError, SamplingParams


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),  # past the engine's int64 tensors: it stopped the engine core
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),  # 0 in float32: logits divided into inf
        ({"repetition_penalty": 1e7}, "repetition_penalty"),
        ({"temperature": 1e39}, "temperature"),  # inf in float32: -inf / inf made the row NaN
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {1: 200}}, "logit_bias"),
    ],
)
def test_bad_values_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_64_bit_bounds_are_accepted():
    assert SamplingParams(top_k=2**63 - 1, seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=2**63 - 1).top_k == 0


def test_defaults_and_normalization():
    params = SamplingParams(stop="END", top_k=-1, logit_bias={"5": "1.5"})
    assert params.stop == ["END"] and params.top_k == 0 and params.logit_bias == {5: 1.5}
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy


def test_vocab_checks():
    with pytest.raises(SamplingParamError, match="vocabulary"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(50)
    with pytest.raises(SamplingParamError, match="vocabulary"):
        SamplingParams(stop_token_ids=[60]).validate_for_vocab(50)


def test_clone_is_independent():
    params = SamplingParams(stop=["a"], seed=1)
    child = params.clone(seed=2)
    child.stop.append("b")
    assert params.stop == ["a"] and params.seed == 1 and child.seed == 2


def test_a_json_schema_of_any_numbers_travels_to_the_engine_core():
    """A schema is JSON: its numbers may pass 64 bits, which msgpack (the engine
    core's wire format) cannot carry. The schema travels as its text, so a client's
    schema never turns into a 500 (schemathesis found one through /v1/responses)."""
    import json

    from heron.engine.serialization import MessageKind, encode_request, pack, unpack
    from heron.request import EngineCoreRequest
    from heron.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 464247755404831132115558989824}}}
    constraint = StructuredOutputsParams(json=schema)
    assert constraint.key() == ("json", json.dumps(schema))
    params = SamplingParams(max_tokens=4, structured_outputs=constraint)
    request = EngineCoreRequest("r", [1, 2], params, eos_token_ids=(2,), max_tokens=4, arrival_time=0.0)
    kind, payload = unpack(pack(MessageKind.ADD, encode_request(request)))
    assert kind == MessageKind.ADD and json.dumps(json.dumps(schema)) in json.dumps(payload)  # the text, intact


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"])
def test_nan_is_refused(name):
    # NaN passes every range comparison: it reached the sampler offline (the HTTP API refuses it)
    with pytest.raises(SamplingParamError, match=name):
        SamplingParams(**{name: float("nan")})


def test_the_samples_of_the_largest_seed_get_seeds_of_their_own():
    # n > 1 gives sample i the seed + i: past 2**63 - 1 it was refused with an error naming a seed nobody sent
    from heron.engine.args import EngineArgs
    from heron.engine.input_processor import InputProcessor, ProcessedPrompt
    from heron.loader.tokenizer import load_tokenizer

    config = EngineArgs(model=None, device="cpu").create_engine_config()
    processor = InputProcessor(config.model, load_tokenizer(config.model))
    requests = processor.make_requests("r", ProcessedPrompt("hi", [1, 2]), SamplingParams(n=3, seed=2**63 - 1))
    assert [request.sampling_params.seed for request in requests] == [2**63 - 1, -(2**63), -(2**63) + 1]


def test_stop_strings_need_text():
    with pytest.raises(SamplingParamError, match="stop"):
        SamplingParams(stop=["."], detokenize=False)
    SamplingParams(stop_token_ids=[13], detokenize=False)  # tokens need no text


def test_numpy_numbers_are_taken_as_python_numbers():
    """A per-prompt seed drawn with numpy was refused: "seed must be a 64-bit signed integer, got np.int64(3)"."""
    import numpy as np

    params = SamplingParams(seed=np.int64(3), top_k=np.int64(5), max_tokens=np.int32(7), temperature=np.float32(0.5))
    assert (params.seed, params.top_k, params.max_tokens, params.temperature) == (3, 5, 7, 0.5)
    assert all(type(value) in (int, float) for value in (params.seed, params.top_k, params.max_tokens,
                                                         params.temperature))
