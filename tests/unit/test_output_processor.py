"""Stop strings, streaming deltas and n > 1 gathering in the output processor."""

import pytest

from heron.engine.core_output import EngineCoreOutput
from heron.engine.input_processor import ProcessedPrompt
from heron.engine.output_processor import OutputProcessor
from heron.engine.stop_strings import StopStringMatcher
from heron.sampling_params import RequestOutputKind, SamplingParams
from heron.worker.runner_output import TokenLogprobs


def test_stop_string_matcher_finds_the_earliest_match_in_new_text():
    matcher = StopStringMatcher(["STOP", "END"], include_in_output=False)
    assert matcher.holdback == 3
    assert matcher.find("abc", 3) is None
    assert matcher.find("abcEN", 2) is None
    assert matcher.find("abcEND", 1) == ("END", 3)
    assert matcher.find("xxSTOPyyEND", 11) == ("STOP", 2)
    assert StopStringMatcher(["END"], include_in_output=True).find("abEND!", 4) == ("END", 5)


def feed(processor, tokenizer, request_id, text_pieces, finish_reason="length"):
    """Feed the tokens of ``text_pieces`` one engine step per piece."""
    outputs = []
    pieces = [tokenizer.encode(p) for p in text_pieces]
    for index, ids in enumerate(pieces):
        final = index == len(pieces) - 1
        result = processor.process_outputs(
            [EngineCoreOutput(request_id, ids, finish_reason=finish_reason if final else None)]
        )
        outputs.append(result)
    return outputs


@pytest.mark.parametrize("include", [False, True])
def test_streamed_deltas_never_leak_a_stop_string(embedded_tokenizer, include):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    params = SamplingParams(stop=["</answer>"], include_stop_str_in_output=include, output_kind=RequestOutputKind.DELTA)
    processor.add_request("r", ProcessedPrompt("q", tok.encode("q")), params)
    results = feed(processor, tok, "r", ["The answer", " is 42</", "answer> and more", " text"])
    deltas = [o.outputs[0].text for r in results for o in r.request_outputs]
    streamed = "".join(deltas)
    expected = "The answer is 42" + ("</answer>" if include else "")
    assert streamed == expected
    assert all("</" not in d for d in deltas) or include
    # the stop finished it on the front-end side: the engine must abort it
    assert results[2].request_ids_to_abort == ["r"]
    last = results[2].request_outputs[-1]
    assert last.finished and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == "</answer>"
    assert results[3].request_outputs == []  # tokens after the stop are ignored


def test_final_only_gathers_n_samples_in_index_order(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY)
    engine_ids = processor.add_request("p", ProcessedPrompt("q", [1, 2]), params)
    assert engine_ids == ["p#0", "p#1"]
    first = processor.process_outputs([EngineCoreOutput("p#1", tok.encode(" world"), finish_reason="stop")])
    assert first.request_outputs == []
    second = processor.process_outputs([EngineCoreOutput("p#0", tok.encode(" hello"), finish_reason="length")])
    [output] = second.request_outputs
    assert output.request_id == "p" and output.finished
    assert [(c.index, c.text, c.finish_reason) for c in output.outputs] == [(0, " hello", "length"), (1, " world", "stop")]
    assert not processor.has_unfinished_requests()


def test_logprobs_are_decoded_and_accumulated(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    params = SamplingParams(logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("r", ProcessedPrompt(None, [1]), params)
    hello = tok.encode("Hello")[0]
    entry = TokenLogprobs([hello, 5], [-0.5, -0.25], rank=2)
    result = processor.process_outputs([EngineCoreOutput("r", [hello], new_logprobs=[entry], finish_reason="length")])
    completion = result.request_outputs[0].outputs[0]
    assert completion.cumulative_logprob == -0.5
    [step] = completion.logprobs
    assert step[hello].rank == 2 and step[hello].decoded_token == "Hello"
    assert step[5].rank == 1 and step[5].logprob == -0.25
