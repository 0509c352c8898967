"""Prefill/decode disaggregation between two engines on a tiny random Llama
(float32, CPU): a prefill engine computes a prompt and keeps its blocks under
a lease; a decode engine pulls them over TCP (ZMQ) instead of prefilling, and
its greedy output is token-identical to transformers. A pull that cannot
happen (the prefill engine gone, the lease expired) is recomputed or fails the
request per policy; the books of both pools balance."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from heron import LLM, SamplingParams
from heron.engine.input_processor import ProcessedPrompt
from heron.worker import kv_pull
from tests.model.conftest import load_reference, random_prompts, reference_greedy

NEW_TOKENS = 8
POOL = dict(dtype="float32", block_size=8, num_kv_blocks=24, max_model_len=96)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompts = random_prompts([45, 29, 60], seed=41)
    reference = load_reference(directory)
    expected = {tuple(p): reference_greedy(reference, p, NEW_TOKENS) for p in prompts}
    return directory, prompts, expected


def engines(directory: str, decode_args: dict | None = None, **producer_args):
    prefill = LLM(directory, kv_transfer_config={"kv_role": "kv_producer", **producer_args}, **POOL)
    decode = LLM(directory, kv_transfer_config={"kv_role": "kv_consumer", "kv_timeout_seconds": 5},
                 **{**POOL, **(decode_args or {})})
    return prefill, decode


def prefill_handles(prefill: LLM, prompts: list[list[int]]) -> list[dict]:
    """Prefill each prompt for a decode engine: the handles (kv_transfer_params) it answers."""
    prefilled = prefill.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(max_tokens=1, temperature=0,
                                                kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
    params = [output.kv_transfer_params for output in prefilled]
    assert all(p is not None and p["do_remote_prefill"] for p in params)
    return params


def prefill_then_decode(prefill: LLM, decode: LLM, prompts: list[list[int]]) -> list:
    return decode_with(decode, prompts, prefill_handles(prefill, prompts))


def decode_with(decode: LLM, prompts: list[list[int]], params: list) -> list:
    outputs = []
    for prompt, kv_params in zip(prompts, params, strict=True):
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, kv_transfer_params=kv_params)
        outputs.append(decode.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0])
    return outputs


def books_balance(llm: LLM) -> None:
    engine = llm.engine.engine_core
    while engine.has_unfinished_requests():  # leases being released
        engine.step()
    manager = engine.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def test_a_decode_engine_pulls_the_prefill_instead_of_computing_it(llama):
    directory, prompts, expected = llama
    prefill, decode = engines(directory)
    outputs = prefill_then_decode(prefill, decode, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in prompts]
    # every full prompt block but the one holding the last token came over the wire
    assert [o.num_cached_tokens for o in outputs] == [(len(p) - 1) // 8 * 8 for p in prompts]
    books_balance(prefill)
    books_balance(decode)


@pytest.mark.parametrize("decode_args", [
    dict(max_num_batched_tokens=16),  # the last partial block and the decodes in chunks
    dict(async_scheduling=True),
    dict(num_kv_blocks=14),  # pulls wait for room, and waiting pulled requests give their blocks back
], ids=["chunked", "async", "tight-pool"])
def test_pulled_prompts_decode_together_in_every_batching_situation(llama, decode_args):
    directory, prompts, expected = llama
    prefill, decode = engines(directory, decode_args)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, kv_transfer_params=handle)
              for handle in prefill_handles(prefill, prompts)]
    outputs = decode.generate(batch, params, use_tqdm=False)  # all at once: loads beside running requests
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in prompts]
    books_balance(prefill)
    books_balance(decode)


def test_a_vanished_prefill_engine_is_recomputed_or_fails_per_policy(llama):
    directory, prompts, expected = llama
    prefill, decode = engines(directory)
    params, = prefill_handles(prefill, prompts[:1])
    prefill.engine.engine_core.shutdown()  # the prefill engine is gone before the pull
    output, = decode_with(decode, prompts[:1], [params])
    assert output.outputs[0].token_ids == expected[tuple(prompts[0])]
    assert output.num_cached_tokens == 0  # nothing came over: computed here
    books_balance(decode)
    strict = LLM(directory, kv_transfer_config={"kv_role": "kv_consumer", "kv_timeout_seconds": 1},
                 kv_load_failure_policy="fail", **POOL)
    failed, = decode_with(strict, prompts[:1], [params])
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    # and why (it said only how many blocks; the reason was in the decode server's log alone)
    assert "KV blocks could not be loaded (the prefill engine at tcp://" in failed.outputs[0].error
    # at once, not after the timeout: nothing listens there any more
    assert "the prefill engine is gone: its connection was refused" in failed.outputs[0].error, failed.outputs[0].error
    books_balance(strict)


def test_an_unclaimed_prefill_lease_expires(llama):
    directory, prompts, _ = llama
    prefill, decode = engines(directory, kv_lease_seconds=0.5)
    prefill.generate([{"prompt_token_ids": prompts[0]}],
                     SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True}),
                     use_tqdm=False)
    engine = prefill.engine.engine_core
    manager = engine.scheduler.kv_cache_manager
    assert engine.has_unfinished_requests() and manager.num_free_blocks < manager.num_blocks  # leased
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    assert not engine.has_unfinished_requests()
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def _handle(address: str, request_id: str = "elsewhere") -> dict:
    return {"do_remote_prefill": True, "remote_engine_address": address, "remote_request_id": request_id,
            "remote_num_blocks": 5, "remote_block_size": 8}


def test_a_handle_for_another_prompt_is_refused_and_poisons_nothing(llama):
    directory, prompts, expected = llama
    prefill, decode = engines(directory)
    wrong = prefill_handles(prefill, prompts[:2])[1]  # the second prompt's blocks, named for the first
    output, = decode_with(decode, prompts[:1], [wrong])
    assert output.outputs[0].token_ids == expected[tuple(prompts[0])] and output.num_cached_tokens == 0
    again, = decode_with(decode, prompts[:1], [None])  # the prefix cache holds the first prompt's own KV
    assert again.outputs[0].token_ids == expected[tuple(prompts[0])]
    right, = decode_with(decode, prompts[1:2], [wrong])  # the lease still serves its own prompt
    assert right.outputs[0].token_ids == expected[tuple(prompts[1])] and right.num_cached_tokens > 0
    books_balance(prefill)
    books_balance(decode)


def test_peers_that_send_garbage_fail_one_pull_and_stop_nothing(llama):
    directory, prompts, expected = llama
    prefill, decode = engines(directory)
    context = zmq.Context()
    liar = context.socket(zmq.ROUTER)
    port = liar.bind_to_random_port("tcp://127.0.0.1")

    def answer_with_a_map() -> None:
        identity, _ = liar.recv_multipart()
        liar.send_multipart([identity, msgpack.packb({"not": "a list"})])

    thread = threading.Thread(target=answer_with_a_map, daemon=True)
    thread.start()
    output, = decode_with(decode, prompts[:1], [_handle(f"tcp://127.0.0.1:{port}")])
    assert output.outputs[0].token_ids == expected[tuple(prompts[0])] and output.num_cached_tokens == 0
    # a two-frame message to the prefill engine's block server
    params, = prefill_handles(prefill, prompts[1:2])
    prober = context.socket(zmq.DEALER)
    prober.connect(params["remote_engine_address"])
    prober.send_multipart([msgpack.packb(["pull", "x", 0, 1]), b"a second frame"])
    time.sleep(0.3)
    # both threads live on: the next real pull comes over the wire
    pulled, = decode_with(decode, prompts[1:2], [params])
    assert pulled.outputs[0].token_ids == expected[tuple(prompts[1])] and pulled.num_cached_tokens > 0
    prober.close(0)
    liar.close(0)
    context.term()
    books_balance(prefill)
    books_balance(decode)


def test_prompt_logprobs_compute_the_prompt_here(llama):
    directory, prompts, _ = llama
    prefill, decode = engines(directory)
    handle, = prefill_handles(prefill, prompts[:1])
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, kv_transfer_params=handle)
    output, = decode.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert len(output.prompt_logprobs) == len(prompts[0]) and output.num_cached_tokens == 0
    books_balance(prefill)  # the lease was released, not left to expire
    books_balance(decode)


def released_soon(prefill: LLM, seconds: float = 3.0) -> bool:
    """Whether the prefill engine's leases are all released within ``seconds``
    (well before they would expire, 10 s by default)."""
    engine = prefill.engine.engine_core
    deadline = time.monotonic() + seconds
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            return False
        engine.step()
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("case", ["block_size_mismatch", "aborted_before_its_pull"])
def test_a_handle_that_will_never_be_pulled_releases_the_lease(llama, case):
    """A decode engine of another block size, or a request aborted before it
    tried its pull, never told the prefill engine: its blocks stayed leased
    until the lease expired, pushing out leases about to be pulled."""
    directory, prompts, expected = llama
    prefill, decode = engines(directory, {"block_size": 16} if case == "block_size_mismatch" else None)
    handle, = prefill_handles(prefill, prompts[:1])
    if case == "block_size_mismatch":
        output, = decode_with(decode, prompts[:1], [handle])
        assert output.outputs[0].token_ids == expected[tuple(prompts[0])]  # recomputed here
    else:
        params = SamplingParams(max_tokens=2, temperature=0, kv_transfer_params=handle)
        decode.engine.add_request("gone", ProcessedPrompt(None, list(prompts[0])), params)
        decode.engine.abort_request("gone")
        decode.engine.step()  # the release goes out with the next step
    assert released_soon(prefill)
    books_balance(prefill)
    books_balance(decode)


def test_an_id_still_loading_is_not_reused(llama):
    directory, prompts, _ = llama
    _, decode = engines(directory)
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # never answers: the pull waits
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    engine = decode.engine
    params = SamplingParams(max_tokens=2, temperature=0, kv_transfer_params=_handle(f"tcp://127.0.0.1:{port}"))
    engine.add_request("x", ProcessedPrompt(None, list(prompts[0])), params)
    engine.step()
    engine.abort_request("x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", ProcessedPrompt(None, list(prompts[1])), SamplingParams(max_tokens=2))
    silent.close(0)
    context.term()
    books_balance(decode)


def test_a_block_size_mismatch_fails_the_request_under_the_fail_policy(llama):
    directory, prompts, _ = llama
    strict = LLM(directory, kv_transfer_config={"kv_role": "kv_consumer", "kv_timeout_seconds": 1},
                 kv_load_failure_policy="fail", **POOL)
    handle = {**_handle("tcp://127.0.0.1:9"), "remote_block_size": 16}
    failed, = decode_with(strict, prompts[:1], [handle])
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert "blocks hold 16 tokens, this engine's" in failed.outputs[0].error
    books_balance(strict)


def test_a_silent_prefill_engine_delays_only_its_own_requests(llama):
    directory, prompts, expected = llama
    prefill = LLM(directory, kv_transfer_config={"kv_role": "kv_producer"}, **POOL)
    decode = LLM(directory, kv_transfer_config={"kv_role": "kv_consumer", "kv_timeout_seconds": 2}, **POOL)
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes the pull, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    handle, = prefill_handles(prefill, prompts[1:2])
    engine = decode.engine
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("stalled", ProcessedPrompt(None, list(prompts[0])),
                       greedy.clone(kv_transfer_params=_handle(f"tcp://127.0.0.1:{port}")))
    engine.add_request("pulled", ProcessedPrompt(None, list(prompts[1])), greedy.clone(kv_transfer_params=handle))
    finished = {}
    while "pulled" not in finished:
        finished.update((output.request_id, output) for output in engine.step() if output.finished)
    # pulled from the live prefill engine while the silent one's pull still waits
    assert "stalled" in engine.engine_core.scheduler.loading
    assert finished["pulled"].outputs[0].token_ids == expected[tuple(prompts[1])]
    assert finished["pulled"].num_cached_tokens > 0
    while engine.has_unfinished_requests():  # the silent peer's pull times out: recomputed here
        finished.update((output.request_id, output) for output in engine.step() if output.finished)
    assert finished["stalled"].outputs[0].token_ids == expected[tuple(prompts[0])]
    assert finished["stalled"].num_cached_tokens == 0
    silent.close(0)
    context.term()
    books_balance(prefill)
    books_balance(decode)


def test_a_long_prompt_comes_over_in_bounded_pulls(llama, monkeypatch):
    directory, prompts, expected = llama
    monkeypatch.setattr(kv_pull, "CHUNK_BYTES", 1)  # one block a pull
    prefill, decode = engines(directory)
    loader = decode.engine.engine_core.model_runner.kv_loader
    assert loader.chunk_blocks == 1
    server = prefill.engine.engine_core.model_runner.kv_server
    pulls = []
    capture = server.codec.capture
    monkeypatch.setattr(server.codec, "capture", lambda block_id: pulls.append(block_id) or capture(block_id))
    outputs = prefill_then_decode(prefill, decode, prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == expected[tuple(prompt)]
        assert output.num_cached_tokens > 0
    assert len(pulls) == sum(output.num_cached_tokens for output in outputs) // POOL["block_size"] > len(prompts)
    books_balance(prefill)
    books_balance(decode)


def test_a_pull_cut_part_way_keeps_the_blocks_that_came(llama, monkeypatch):
    """A pull whose third run failed reported every block failed: the two that
    had come whole were thrown away and the whole prompt computed again."""
    directory, prompts, expected = llama
    monkeypatch.setattr(kv_pull, "CHUNK_BYTES", 1)  # one block a pull
    prefill, decode = engines(directory)
    server = prefill.engine.engine_core.model_runner.kv_server
    captured, capture = [], server.codec.capture

    def fail_the_third(block_id: int):
        captured.append(block_id)
        if len(captured) == 3:
            raise RuntimeError("the copy failed")
        return capture(block_id)

    monkeypatch.setattr(server.codec, "capture", fail_the_third)
    output, = prefill_then_decode(prefill, decode, prompts[:1])
    assert output.outputs[0].token_ids == expected[tuple(prompts[0])]
    assert output.num_cached_tokens == 2 * POOL["block_size"]
    books_balance(prefill)
    books_balance(decode)


def test_a_lease_withdrawn_during_a_copy_waits_for_it_and_steps_never_do(llama, monkeypatch):
    directory, prompts, _ = llama
    prefill = LLM(directory, kv_transfer_config={"kv_role": "kv_producer"}, **POOL)
    handle, = prefill_handles(prefill, prompts[:1])
    server = prefill.engine.engine_core.model_runner.kv_server
    copying, proceed = threading.Event(), threading.Event()
    capture = server.codec.capture

    def slow_capture(block_id: int):
        copying.set()
        proceed.wait(10)
        return capture(block_id)

    monkeypatch.setattr(server.codec, "capture", slow_capture)
    blocks, hashes = server._offers[handle["remote_request_id"]]
    context = zmq.Context()
    puller = context.socket(zmq.DEALER)
    puller.connect(handle["remote_engine_address"])
    puller.send(msgpack.packb(["pull", handle["remote_request_id"], 0, 1, hashes[:1]]))
    assert copying.wait(10)
    server.offer("another", [], [])  # what a step does: never waits for a copy
    assert server.take_released() == []
    withdraw = threading.Thread(target=server.withdraw, args=(handle["remote_request_id"],))
    withdraw.start()
    withdraw.join(0.3)
    assert withdraw.is_alive()  # the blocks are being read: not free to reuse yet
    proceed.set()
    withdraw.join(10)
    assert not withdraw.is_alive()
    header, block = puller.recv_multipart()
    assert msgpack.unpackb(header)[0] is True and len(block) == server.codec.block_bytes
    puller.close(0)
    context.term()


def test_leases_give_way_when_the_pool_is_short(llama):
    directory, prompts, expected = llama
    prefill, decode = engines(directory, kv_lease_seconds=600)  # no decode engine is coming for a while
    handles = prefill_handles(prefill, prompts)
    engine = prefill.engine.engine_core
    manager = engine.scheduler.kv_cache_manager
    assert len(engine.scheduler._leases) == 3
    long_prompt, = random_prompts([90], seed=7)  # 12 blocks with its answer: more than the leases leave
    assert manager.num_free_blocks < 12
    output, = prefill.generate([{"prompt_token_ids": long_prompt}],
                               SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 6
    leased = [request_id for request_id in engine.scheduler._leases]
    assert handles[0]["remote_request_id"] not in leased and len(leased) < 3  # the oldest gave way first
    manager.check_integrity()
    given_up, = decode_with(decode, prompts[:1], handles[:1])  # its decode engine computes the prompt itself
    assert given_up.outputs[0].token_ids == expected[tuple(prompts[0])] and given_up.num_cached_tokens == 0
    books_balance(decode)


class ForgingPeer:
    """A prefill engine of the client's own: it relays each pull to a real one and
    answers it with the blocks' bytes zeroed (the layout's fingerprint kept)."""

    def __init__(self, real_address: str) -> None:
        self.context = zmq.Context()
        self.front = self.context.socket(zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.back = self.context.socket(zmq.DEALER)
        self.back.connect(real_address)
        self.thread = threading.Thread(target=self._relay, daemon=True)
        self.thread.start()

    def _relay(self) -> None:
        try:
            while True:
                identity, message = self.front.recv_multipart()
                self.back.send(message)
                if msgpack.unpackb(message)[0] == "pull":
                    header, *blocks = self.back.recv_multipart()
                    self.front.send_multipart([identity, header, *(bytes(len(block)) for block in blocks)])
        except zmq.ContextTerminated:  # close(): the sockets are closed by the thread that uses them
            pass
        finally:
            self.front.close(0)
            self.back.close(0)

    def close(self) -> None:
        self.context.term()  # wakes the relay, which closes its sockets; term returns once they are
        self.thread.join(10)


@pytest.mark.parametrize("vouched", [False, True], ids=["any-peer", "kv-peers"])
def test_blocks_from_a_peer_no_one_vouched_for_serve_only_their_own_request(llama, vouched):
    """A handle is the client's to write: one naming a server of its own put
    that server's bytes in the decode engine's prefix cache under the prompt's
    hashes, and every later request with the prompt read them (wrong tokens,
    counted as cached). With kv_peers empty (any peer) the pulled blocks serve
    only the request that pulled them; with the peers named they are shared."""
    directory, prompts, expected = llama
    handle, = prefill_handles(prefill := engines(directory)[0], prompts[:1])
    forger = ForgingPeer(handle["remote_engine_address"])
    peers = {"kv_peers": [forger.address.removeprefix("tcp://")]} if vouched else {}
    decode = LLM(directory, kv_transfer_config={"kv_role": "kv_consumer", "kv_timeout_seconds": 5, **peers}, **POOL)
    try:
        forged, = decode_with(decode, prompts[:1], [{**handle, "remote_engine_address": forger.address}])
        assert forged.num_cached_tokens > 0  # the zeroed blocks came over (the answer is the client's own)
        honest, = decode_with(decode, prompts[:1], [None])
        if vouched:  # the operator named the peer: what it sends is shared, as before
            assert honest.num_cached_tokens > 0
        else:
            assert honest.num_cached_tokens == 0 and honest.outputs[0].token_ids == expected[tuple(prompts[0])]
    finally:
        forger.close()
    books_balance(prefill)
    books_balance(decode)
