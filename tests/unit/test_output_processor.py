"""Stop strings, streaming deltas and n > 1 gathering in the output processor."""

import pytest

from heron.engine.input_processor import ProcessedPrompt
from heron.engine.output_processor import _TEXT_BATCH as TEXT_BATCH
from heron.engine.output_processor import OutputProcessor
from heron.engine.stop_strings import StopStringMatcher
from heron.sampling_params import RequestOutputKind, SamplingParams
from heron.step_outputs import EngineCoreOutput, TokenLogprobs


def test_stop_string_matcher_finds_the_earliest_match_in_new_text():
    matcher = StopStringMatcher(["STOP", "END"], include_in_output=False)
    assert matcher.holdback == 3
    assert matcher.find("abc", 3) is None
    assert matcher.find("abcEN", 2) is None
    assert matcher.find("abcEND", 1) == ("END", 3)
    assert matcher.find("xxSTOPyyEND", 11) == ("STOP", 2)
    assert StopStringMatcher(["END"], include_in_output=True).find("abEND!", 4) == ("END", 5)


def test_only_an_end_that_could_begin_a_stop_string_is_held_back():
    """The last max(len(stop)) - 1 characters were always held: under a stop of 256
    characters every streamed chunk came 255 characters late, and under
    "<|im_start|>" a short answer streamed nothing until its end."""
    matcher = StopStringMatcher(["STOP", "<|im_start|>", "aab"], include_in_output=False)
    assert matcher.held("plain words") == 0
    assert matcher.held("words ST") == 2 and matcher.held("words STO") == 3 and matcher.held("words S") == 1
    assert matcher.held("x <|im_") == 5 and matcher.held("x <|im_start") == 10
    assert matcher.held("xaa") == 2 and matcher.held("xa") == 1  # the longest end that begins one
    assert matcher.held("STOPX") == 0
    assert StopStringMatcher(["STOP"], include_in_output=True).held("ST") == 0
    long_stop = "x" * 255 + "y"
    assert StopStringMatcher([long_stop], include_in_output=False).held("answer text") == 0
    assert StopStringMatcher([long_stop], include_in_output=False).held("answer xxx") == 3


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


def test_text_that_cannot_begin_a_stop_string_streams_at_once(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    params = SamplingParams(stop=["<|im_start|>"], output_kind=RequestOutputKind.DELTA)
    processor.add_request("r", ProcessedPrompt("q", tok.encode("q")), params)
    results = feed(processor, tok, "r", ["Hello", " world <|im", "_end|> after"])
    deltas = [o.outputs[0].text for r in results for o in r.request_outputs]
    assert deltas == ["Hello", " world ", "<|im_end|> after"]  # only "<|im" waited for its next token


def test_final_only_gathers_n_samples_in_index_order(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY)
    engine_ids = processor.add_request("p", ProcessedPrompt("q", [1, 2]), params)
    assert engine_ids == ["p#0", "p#1"]
    end = [tok.eos_token_id]  # the engine stops a request on EOS: its last token
    first = processor.process_outputs([EngineCoreOutput("p#1", tok.encode(" world") + end, finish_reason="stop")])
    assert first.request_outputs == []
    second = processor.process_outputs([EngineCoreOutput("p#0", tok.encode(" hello"), finish_reason="length")])
    [output] = second.request_outputs
    assert output.request_id == "p" and output.finished
    assert [(c.index, c.text, c.finish_reason) for c in output.outputs] == [(0, " hello", "length"),
                                                                           (1, " world", "stop")]
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


def random_steps(vocab_size: int, num_tokens: int, seed: int) -> list[list[int]]:
    """Random token ids (invalid UTF-8 too, for a byte-level vocabulary) in steps of
    1-3 tokens (as speculative decoding delivers them)."""
    import random

    rng = random.Random(seed)
    ids = [rng.randrange(vocab_size) for _ in range(num_tokens)]
    steps, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 3)
        steps.append(ids[start : start + size])
        start += size
    return steps


@pytest.mark.parametrize("num_tokens", [5, 64, 200])
def test_final_only_text_detokenized_at_the_end_equals_the_streamed_text(embedded_tokenizer, num_tokens):
    """Final-only requests without stop strings detokenize in batches and at the end;
    their text must be exactly what streaming (delta and cumulative) builds."""
    tok = embedded_tokenizer
    prompt = ProcessedPrompt("q", tok.encode("Say something: 🦜"))
    for seed in range(4):
        steps = random_steps(len(tok), num_tokens, seed)
        if seed == 3:  # end inside a character: only the final flush emits its bytes
            steps[-1] = tok.encode("ab 🦜")[:-1]
        processor = OutputProcessor(tok)
        kinds = {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA,
                 "cumulative": RequestOutputKind.CUMULATIVE}
        for name, kind in kinds.items():
            processor.add_request(name, prompt, SamplingParams(n=2 if name == "final" else 1, output_kind=kind))
        assert processor.requests["final#0"].text_at_end and not processor.requests["delta"].text_at_end
        texts: dict[str, str] = {"delta": ""}
        for index, ids in enumerate(steps):
            finish = "length" if index == len(steps) - 1 else None
            outputs = [EngineCoreOutput(rid, ids, finish_reason=finish)
                       for rid in ("final#0", "final#1", "delta", "cumulative")]
            for output in processor.process_outputs(outputs).request_outputs:
                if output.request_id == "delta":
                    texts["delta"] += output.outputs[0].text
                elif output.request_id == "cumulative":
                    texts["cumulative"] = output.outputs[0].text
                else:
                    assert output.finished and index == len(steps) - 1
                    texts["final"] = output.outputs[0].text
                    assert output.outputs[1].text == texts["final"]
                    assert output.outputs[0].token_ids == [t for step in steps for t in step]
            if index < len(steps) - 1:  # detokenized in batches, not all at the end
                state = processor.requests["final#0"]
                assert len(state.token_ids) - state.num_detokenized < TEXT_BATCH
        assert texts["final"] == texts["delta"] == texts["cumulative"]
        assert texts["final"]


def test_final_only_with_stop_strings_or_logprobs_still_works(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    stop = SamplingParams(stop=["42"], output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("s", ProcessedPrompt("q", tok.encode("q")), stop)
    assert not processor.requests["s"].text_at_end  # stop strings are matched per step
    results = feed(processor, tok, "s", ["The answer", " is 42", " and more"])
    assert (results[1].request_outputs[0].outputs[0].text == "The answer is "
            and results[1].request_ids_to_abort == ["s"])
    params = SamplingParams(logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("l", ProcessedPrompt(None, [1]), params)
    assert processor.requests["l"].text_at_end
    ids = tok.encode("Hello world")
    for index, token in enumerate(ids):
        entry = TokenLogprobs([token], [-1.0], rank=1)
        finish = "length" if index == len(ids) - 1 else None
        result = processor.process_outputs([EngineCoreOutput("l", [token], new_logprobs=[entry], finish_reason=finish)])
    completion = result.request_outputs[0].outputs[0]
    assert completion.text == "Hello world" and completion.cumulative_logprob == -len(ids)
    assert len(completion.logprobs) == len(ids)


def test_text_batches_of_requests_admitted_together_are_staggered(embedded_tokenizer):
    """Requests that start together detokenize on different steps, not all at once."""
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [f"r{i}" for i in range(2 * TEXT_BATCH)]
    for request_id in ids:
        processor.add_request(request_id, ProcessedPrompt("q", tok.encode("q")), params)
    token = tok.encode(" a")[0]
    caught_up_per_step = []
    for _ in range(TEXT_BATCH):
        before = {rid: processor.requests[rid].num_detokenized for rid in ids}
        processor.process_outputs([EngineCoreOutput(rid, [token]) for rid in ids])
        caught_up_per_step.append(sum(processor.requests[rid].num_detokenized != before[rid] for rid in ids))
    assert caught_up_per_step == [2] * TEXT_BATCH  # two of the 128 requests on each step


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_is_in_the_token_ids_not_the_text(embedded_tokenizer, kind, include):
    """The engine stopped on a stop_token_ids id ("." here) or EOS: as on vLLM,
    its text is left out unless include_stop_str_in_output (it was always in)."""
    tok = embedded_tokenizer
    period = tok.encode(".")
    params = SamplingParams(stop_token_ids=period, include_stop_str_in_output=include, output_kind=kind)
    processor = OutputProcessor(tok)
    processor.add_request("r", ProcessedPrompt("q", tok.encode("q")), params)
    results = feed(processor, tok, "r", [" Paris", "."], finish_reason="stop")
    final = [o for r in results for o in r.request_outputs][-1].outputs[0]
    text = "".join(o.outputs[0].text for r in results for o in r.request_outputs) if kind == RequestOutputKind.DELTA \
        else final.text
    assert text == (" Paris." if include else " Paris")
    assert final.token_ids[-1:] == period or kind == RequestOutputKind.DELTA


def test_whole_texts_hold_back_what_may_begin_a_stop_string(embedded_tokenizer):
    """Cumulative outputs showed text that then turned out to begin the stop
    string, and the final text was shorter than an earlier one."""
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    params = SamplingParams(stop=[" world. Stop"], output_kind=RequestOutputKind.CUMULATIVE)
    processor.add_request("r", ProcessedPrompt("q", tok.encode("q")), params)
    results = feed(processor, tok, "r", ["Hello", " world", ".", " Stop", " here"])
    texts = [o.outputs[0].text for r in results for o in r.request_outputs]
    assert texts[-1] == "Hello" and all(len(a) <= len(b) for a, b in zip(texts, texts[1:]))
    assert all(" world" not in text for text in texts)



def test_tokens_cut_by_a_stop_string_are_not_counted_as_generated(embedded_tokenizer):
    """A step of several tokens (speculative decoding) that a stop string ends
    inside counted the tokens after it as generated, though never served."""
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    processor.add_request("r", ProcessedPrompt("q", tok.encode("q")), SamplingParams(stop=["STOP"]))
    results = feed(processor, tok, "r", ["one two", " three STOP four five six seven"])
    [finished] = results[1].request_outputs
    served = len(finished.outputs[0].token_ids)
    assert sum(result.iteration_stats.num_generation_tokens for result in results) == served
    assert results[1].iteration_stats.finished_requests[0].num_generation_tokens == served
