"""GGUF: the header reader against gguf-py, K-quant dequantization against
decoders written from the ggml spec, and a tiny mixed-quantization Llama GGUF
loaded by heron and by transformers with identical results."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter

from heron import LLM, SamplingParams
from heron.loader.gguf_file import GGUFFile
from tests.model.conftest import build_tiny_model, random_prompts, reference_greedy
from tests.model.gguf_builder import encode, random_k_quant_rows, write_tiny_llama_gguf

ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]


def f16(raw: np.ndarray) -> float:
    return float(raw.view(np.float16)[0])


def q4_k_reference(block: np.ndarray) -> np.ndarray:
    """One 256-value Q4_K block, decoded by hand from ggml's definition."""
    d, dmin = f16(block[0:2]), f16(block[2:4])
    scales, qs = block[4:16].astype(np.int32), block[16:144].astype(np.int32)

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out = []
    for chunk in range(4):
        q = qs[chunk * 32 : chunk * 32 + 32]
        sc1, m1 = scale_min(2 * chunk)
        sc2, m2 = scale_min(2 * chunk + 1)
        out.extend(d * sc1 * (q & 0xF) - dmin * m1)
        out.extend(d * sc2 * (q >> 4) - dmin * m2)
    return np.array(out, dtype=np.float32)


def q6_k_reference(block: np.ndarray) -> np.ndarray:
    """One 256-value Q6_K block, decoded by hand from ggml's definition."""
    ql, qh = block[0:128].astype(np.int32), block[128:192].astype(np.int32)
    scales = block[192:208].view(np.int8).astype(np.float32)
    d = f16(block[208:210])
    y = np.zeros(256, dtype=np.float32)
    for half in range(2):
        l_, h_, s_, y_ = ql[64 * half :], qh[32 * half :], scales[8 * half :], 128 * half
        for lane in range(32):
            group = lane // 16
            q1 = ((l_[lane] & 0xF) | (((h_[lane] >> 0) & 3) << 4)) - 32
            q2 = ((l_[lane + 32] & 0xF) | (((h_[lane] >> 2) & 3) << 4)) - 32
            q3 = ((l_[lane] >> 4) | (((h_[lane] >> 4) & 3) << 4)) - 32
            q4 = ((l_[lane + 32] >> 4) | (((h_[lane] >> 6) & 3) << 4)) - 32
            y[y_ + lane] = d * s_[group] * q1
            y[y_ + lane + 32] = d * s_[group + 2] * q2
            y[y_ + lane + 64] = d * s_[group + 4] * q3
            y[y_ + lane + 96] = d * s_[group + 6] * q4
    return y


@pytest.fixture(scope="module")
def all_types_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "types.gguf")
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_string("test.note", "every supported tensor type")
    writer.add_array("test.numbers", [1, 2, 3])
    sources = {}
    for index, qtype in enumerate(ALL_TYPES):
        source = rng.standard_normal((4, 512)).astype(np.float32)
        sources[qtype.name] = source
        writer.add_tensor(f"t.{qtype.name}", encode(source, qtype, seed=index), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, sources


def test_reader_matches_gguf_py_for_every_type(all_types_file):
    from gguf.quants import dequantize

    path, sources = all_types_file
    ours = GGUFFile(path)
    theirs = GGUFReader(path)
    assert ours.metadata["test.note"] == "every supported tensor type"
    assert ours.metadata["test.numbers"] == [1, 2, 3]
    for tensor in theirs.tensors:
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(4, 512)
        got = ours.dequantize(tensor.name)
        assert got.dtype == np.float32 and got.shape == (4, 512)
        np.testing.assert_array_equal(got, expected)
    # lossless and near-lossless types reproduce their source
    np.testing.assert_array_equal(ours.dequantize("t.F32"), sources["F32"])
    np.testing.assert_allclose(ours.dequantize("t.Q8_0"), sources["Q8_0"], atol=0.05)
    np.testing.assert_allclose(ours.dequantize("t.Q4_0"), sources["Q4_0"], atol=0.6)


@pytest.mark.parametrize("qtype, reference", [(Q.Q4_K, q4_k_reference), (Q.Q6_K, q6_k_reference)])
def test_k_quants_dequantize_per_the_ggml_spec(all_types_file, qtype, reference):
    path, _ = all_types_file
    got = GGUFFile(path).dequantize(f"t.{qtype.name}")
    raw = random_k_quant_rows(qtype, 4, 512, seed=ALL_TYPES.index(qtype))
    blocks = raw.reshape(-1, raw.shape[1] // 2)
    expected = np.concatenate([reference(block) for block in blocks]).reshape(4, 512)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_not_a_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))


def test_a_truncated_gguf_says_so(all_types_file, tmp_path):
    """A partial download: cut in the header it was a struct.error traceback; cut
    in the tensor data it failed only at weight loading, as a reshape error."""
    data = open(all_types_file[0], "rb").read()
    cut = tmp_path / "cut.gguf"
    for size, where in ((100, "header is truncated"), (len(data) - 1000, "past the end of the file")):
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=where):
            GGUFFile(str(cut))


def raw_gguf(tensors: list[tuple[str, list[int], int, int]], metadata: bytes = b"", kv_count: int = 0) -> bytes:
    """A GGUF v3 file written byte by byte (what gguf-py's writer refuses to write):
    tensor infos (name, ggml dims, type, offset), then 256 bytes of data."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    data = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), kv_count) + metadata
    for name, dims, ggml_type, offset in tensors:
        data += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", dim) for dim in dims)
        data += struct.pack("<IQ", ggml_type, offset)
    return data + bytes(-len(data) % 32) + bytes(256)


NESTED_ARRAYS = struct.pack("<Q", 3) + b"key" + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 \
    + struct.pack("<IQ", 4, 0)


@pytest.mark.parametrize("tensors, metadata, message", [
    ([("t", [32, 0], 0, 0)], b"", "tensor 't' has a dimension of 0"),  # a ZeroDivisionError traceback
    # numpy's product wrapped to 0 bytes: the check that the data lies in the file passed, then "cannot reshape"
    ([("t", [2**32, 2**32], 0, 0)], b"", "past the end of the file"),
    ([("t", [8], 0, 0), ("t", [8], 0, 32)], b"", "two tensors named 't'"),  # the later one silently won
    ([("t", [8], 0, 4)], b"", "offset 4, not a multiple of the file's alignment 32"),
    ([], NESTED_ARRAYS, "header is truncated or damaged"),  # a RecursionError traceback
])
def test_a_crafted_header_is_refused_naming_what_is_wrong(tmp_path, tensors, metadata, message):
    path = tmp_path / "crafted.gguf"
    path.write_bytes(raw_gguf(tensors, metadata, kv_count=1 if metadata else 0))
    with pytest.raises(ValueError, match=message) as refused:
        GGUFFile(str(path))
    assert str(path) in str(refused.value)


def test_a_damaged_gguf_header_is_a_format_error_naming_the_file(tiny_gguf, tmp_path):
    """A key length with its high byte set was an OverflowError traceback, a
    renamed hyperparameter a TypeError from int(None); of 400 random header
    corruptions, 37 escaped as tracebacks."""
    from heron.loader.gguf_file import GGUFFormatError
    from heron.loader.gguf_model import gguf_to_hf_config

    source = open(tiny_gguf, "rb").read()
    damaged = tmp_path / "damaged.gguf"

    def load(data: bytes) -> None:
        damaged.write_bytes(data)
        gguf_to_hf_config(GGUFFile(str(damaged)))

    long_key = bytearray(source)
    long_key[31] = 0xFF  # the high byte of the first metadata key's length
    renamed = source.replace(b"llama.attention.head_count\x04", b"llama.attention.Xead_count\x04", 1)
    for data, message in ((bytes(long_key), "header is truncated or damaged"),
                          (renamed, "no valid llama.attention.head_count")):
        with pytest.raises(GGUFFormatError, match=message):
            load(data)
    rng = np.random.default_rng(0)
    for _ in range(150):
        data = bytearray(source)
        for position in rng.integers(4, 2000, size=rng.integers(1, 4)):
            data[position] = rng.integers(256)
        try:
            load(bytes(data))
        except GGUFFormatError as exc:
            assert str(damaged) in str(exc)
        except ValueError:
            pass  # a clear error of another kind (an unknown architecture, say): the CLI reports it too


MODEL_HEADER = {"llama.attention.head_count": 4, "llama.embedding_length": 64}


@pytest.mark.parametrize("metadata, message", [
    ({"general.type": "adapter"}, "is a GGUF adapter"),
    ({"split.count": 3, "split.no": 0}, "part 1 of a GGUF split into 3 files"),
    ({**MODEL_HEADER, "llama.rope.scaling.type": "su"}, "GGUF rope scaling 'su' is not supported"),
    ({**MODEL_HEADER, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.yarn_log_multiplier": 1},
     "YaRN rope scaling with rope.scaling.yarn_log_multiplier .* is not supported"),
])
def test_gguf_files_that_are_no_whole_model_are_named(tmp_path, metadata, message):
    """A LoRA adapter gave TypeError: int() ... NoneType; a split's first part said
    that weights were missing; a rope scaling heron does not run was "damaged
    or incomplete" metadata."""
    from heron.loader.gguf_model import gguf_to_hf_config

    path = str(tmp_path / "part-00001-of-00003.gguf")
    writer = GGUFWriter(path, "llama")
    for key, value in metadata.items():
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)
    writer.add_tensor("t", np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=message) as refused:
        gguf_to_hf_config(GGUFFile(path))
    assert "damaged" not in str(refused.value)  # it read "the GGUF metadata is damaged or incomplete (...)"


def test_a_tensor_whose_rows_are_not_whole_blocks_is_named(tmp_path):
    """It passed the header check and failed at weight loading, in the engine
    core, as numpy's "cannot reshape array" with no file or tensor named."""
    path = str(tmp_path / "odd.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("odd_rows_tensor", np.zeros((2, 48), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(open(path, "rb").read())
    type_at = data.index(b"odd_rows_tensor") + len("odd_rows_tensor") + 4 + 8 * 2  # after n_dims and two dims
    data[type_at:type_at + 4] = (8).to_bytes(4, "little")  # F32 -> Q8_0, whose blocks hold 32 values
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"odd\.gguf.*'odd_rows_tensor' has rows of 48 values"):
        GGUFFile(path)


@pytest.fixture(scope="module")
def tiny_hf_llama(tmp_path_factory, embedded_tokenizer):
    from transformers import AutoModelForCausalLM

    directory = str(tmp_path_factory.mktemp("tiny-llama-src"))
    build_tiny_model(directory, dict(model_type="llama", intermediate_size=256, hidden_size=256,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
                     embedded_tokenizer)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


@pytest.mark.parametrize("damage, message", [
    (dict(drop=["blk.1.ffn_up.weight"]), r"lacks 1 of the model's tensors \(blk\.1\.ffn_up\.weight\)"),
    (dict(block_count=3), r"lacks 9 of the model's tensors \(blk\.2\.attn_norm\.weight"),
    (dict(block_count=1), r"holds tensors of layer 1, but its metadata says llama\.block_count = 1"),
    (dict(feed_forward_length=128), r"'blk\.0\.ffn_gate\.weight' has shape \(256, 256\), but the metadata "
                                    r"implies \(128, 256\)"),
    (dict(head_count_kv=3), r"head_count_kv is 3, which does not divide llama\.attention\.head_count \(4\)"),
    (dict(head_count_kv=0), r"head_count_kv is 0"),
    # each failed in the engine core: "unexpected tensor", a shape error in the rotary embedding, or (a Mixtral)
    # it was called an incomplete download
    (dict(extra={"blk.0.junk.weight": np.ones(8)}), r"holds 1 tensor\(s\) heron's llama model does not read "
                                                      r"\(blk\.0\.junk\.weight\)"),
    (dict(extra={"rope_freqs.weight": np.ones(5)}), r"'rope_freqs\.weight' has shape \(5,\), but the metadata "
                                                     r"implies \(32,\)"),
    (dict(keys={"llama.expert_count": 8}), r"is a mixture-of-experts model \(llama\.expert_count = 8\)"),
])
def test_a_gguf_whose_tensors_do_not_match_its_metadata_is_refused_from_the_header(
        tiny_hf_llama, tmp_path, monkeypatch, damage, message):
    """Caught only as the engine core loaded the weights (under `heron serve` a
    traceback and exit 1, after a float copy was written to the weight cache),
    or never: a head_count_kv that does not divide head_count served a one-token
    prompt, then the engine died on a longer one. Refused now where every process
    reads the config, with nothing written."""
    from heron.loader.gguf_model import gguf_to_hf_config

    path = str(tmp_path / "damaged.gguf")
    write_tiny_llama_gguf(path, tiny_hf_llama, {}, **damage)
    with pytest.raises(ValueError, match=message):
        gguf_to_hf_config(GGUFFile(path))
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=message):
        LLM(path, max_model_len=64, num_kv_blocks=16)
    assert not os.path.exists(tmp_path / "cache" / "weights") or not os.listdir(tmp_path / "cache" / "weights")


def test_the_header_expects_the_biases_the_native_attention_has():
    """Qwen2's Q/K/V biases were expected only where block 0 had one: a file
    lacking that one (or all) passed, and failed in the engine core."""
    from heron.loader.arch_config import arch_config_from_dict
    from heron.loader.gguf_model import _expected_shapes

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=32)
    qwen2 = _expected_shapes(arch_config_from_dict(dict(model_type="qwen2", **sizes)))
    assert qwen2["blk.0.attn_q.bias"] == (64,) and qwen2["blk.0.attn_v.bias"] == (32,)
    assert "blk.0.attn_output.bias" not in qwen2
    llama = _expected_shapes(arch_config_from_dict(dict(model_type="llama", attention_bias=True, **sizes)))
    assert llama["blk.0.attn_output.bias"] == (64,) and llama["blk.0.attn_k.bias"] == (32,)
    mistral = _expected_shapes(arch_config_from_dict(dict(model_type="mistral", **sizes)))
    assert not any(name.endswith(".bias") for name in mistral)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_hf_llama):
    path = str(tmp_path_factory.mktemp("tiny-llama-gguf") / "tiny.gguf")
    write_tiny_llama_gguf(path, tiny_hf_llama, {
        "token_embd": Q.Q8_0, "output": Q.Q6_K, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.F16,
        "attn_output": Q.BF16, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q8_0, "ffn_down": Q.F32,
    })
    return path


def test_tiny_mixed_quant_gguf_matches_transformers(tiny_gguf):
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_gguf, dtype="float32", quantization="none", max_model_len=128, num_kv_blocks=32,
              max_num_batched_tokens=16)
    config = llm.config.model.hf_config
    assert (config.hidden_size, config.num_key_value_heads, config.tie_word_embeddings) == (256, 2, False)
    reference = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(tiny_gguf), gguf_file=os.path.basename(tiny_gguf), dtype=torch.float32
    ).eval()
    prompts = random_prompts([7, 30], seed=11)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 10)
    # the tokenizer and chat template came from the GGUF metadata
    assert llm.get_tokenizer().encode("Hello world") == [19556, 905]
    assert "<|im_start|>" in llm.get_tokenizer().chat_template


def test_a_llama_gguf_with_attention_biases_matches_its_source(tmp_path, embedded_tokenizer):
    """llama.cpp reads a Llama's optional Q/K/V/O biases; heron's config never
    said attention_bias, so such a file failed in the engine core ("no place")."""
    from transformers import AutoModelForCausalLM

    directory = build_tiny_model(str(tmp_path / "src"), dict(model_type="llama", attention_bias=True),
                                 embedded_tokenizer)
    source = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():  # (initialized to zero: biases that count)
        for name, parameter in source.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
    path = str(tmp_path / "biased.gguf")
    write_tiny_llama_gguf(path, source, {})
    llm = LLM(path, dtype="float32", quantization="none", max_model_len=128, num_kv_blocks=32)
    prompts = random_prompts([9, 21], seed=5)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == reference_greedy(source, prompt, 8)


def test_a_yarn_gguf_matches_transformers(tmp_path, embedded_tokenizer):
    """llama.cpp's rope.scaling.* keys for YaRN (Qwen's long-context GGUFs): they
    were refused ("GGUF rope scaling 'yarn' is not supported")."""
    from transformers import AutoModelForCausalLM

    directory = build_tiny_model(str(tmp_path / "src"), dict(model_type="llama", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}),
        embedded_tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    path = str(tmp_path / "yarn.gguf")
    write_tiny_llama_gguf(path, reference, {})
    llm = LLM(path, dtype="float32", quantization="none", max_model_len=128, num_kv_blocks=32)
    assert llm.config.model.hf_config.rope_parameters["rope_type"] == "yarn"
    prompts = random_prompts([7, 45], seed=12)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 10)


def test_end_of_turn_tokens_end_generation(tmp_path, embedded_tokenizer, monkeypatch):
    """An instruct GGUF whose EOS is <|endoftext|> and whose end-of-turn token is
    <|im_end|> (llama.cpp's tokenizer.ggml.eot_token_id; Llama 3.1's eom too):
    only EOS stopped generation, so chat ran past the end of its turn."""
    from transformers import AutoModelForCausalLM

    directory = build_tiny_model(str(tmp_path / "src"), dict(model_type="llama"), embedded_tokenizer)
    add_eos = GGUFWriter.add_eos_token_id

    def eos_and_eot(writer, _):
        add_eos(writer, 0)  # <|endoftext|>
        writer.add_eot_token_id(2)  # <|im_end|>
        writer.add_eom_token_id(2)  # the same id again: counted once

    monkeypatch.setattr(GGUFWriter, "add_eos_token_id", eos_and_eot)
    path = str(tmp_path / "eot.gguf")
    write_tiny_llama_gguf(path, AutoModelForCausalLM.from_pretrained(directory), {})
    llm = LLM(path, dtype="float32", max_model_len=64, num_kv_blocks=16)
    assert llm.engine.input_processor.eos_token_ids == (0, 2)


def test_convert_writes_an_equivalent_hf_directory(tiny_gguf, tmp_path):
    from heron.engine.args import EngineArgs
    from heron.entrypoints.convert import export_hf_directory

    config = EngineArgs(model=tiny_gguf, dtype="float32", max_model_len=128).create_engine_config()
    output = export_hf_directory(config, str(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(output))
    with open(os.path.join(output, "config.json")) as file:  # transformers' key since 4.56 (torch_dtype: a warning)
        written = json.load(file)
    assert written["dtype"] == "float32" and "torch_dtype" not in written
    prompts = random_prompts([9], seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    original = LLM(tiny_gguf, dtype="float32", max_model_len=128, num_kv_blocks=16).generate(prompts, params,
                                                                                              use_tqdm=False)
    converted = LLM(output, dtype="float32", max_model_len=128, num_kv_blocks=16).generate(prompts, params,
                                                                                           use_tqdm=False)
    assert converted[0].outputs[0].token_ids == original[0].outputs[0].token_ids


def test_convert_writes_float32_into_a_new_directory_only(tiny_gguf, tmp_path, monkeypatch, capsys):
    """Written into a checkpoint's directory, its old shards and index stayed
    and won (heron and transformers loaded different weights from it); an
    --output that is a file was a FileExistsError traceback; with no --dtype a
    CPU with native bfloat16 wrote lossy bfloat16."""
    import json

    from heron.engine import resolve
    from heron.entrypoints.cli import main

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "file").write_text("")
    for output, message in ((taken, "is not empty"), (tmp_path / "file", "is a file")):
        assert main(["convert", "--model", tiny_gguf, "--output", str(output)]) == 2
        assert message in capsys.readouterr().err
    # an asked-for quantization is said to apply when serving (float32 was written without a word)
    assert main(["convert", "--model", tiny_gguf, "--quantization", "int4", "--output", str(tmp_path / "q")]) == 2
    assert "writes float weights" in capsys.readouterr().err and not (tmp_path / "q").exists()
    monkeypatch.setattr(resolve, "cpu_has_native_bf16", lambda: True)  # where "auto" means bfloat16
    written = tmp_path / "hf"
    assert main(["convert", "--model", tiny_gguf, "--quantization", "none", "--output", str(written)]) == 0
    config = json.loads((written / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"


def test_convert_keeps_llama3_rope_scaling(tmp_path, embedded_tokenizer):
    """A Llama 3.1-style GGUF keeps its RoPE scaling as per-frequency factors
    (rope_freqs.weight); the converted config.json said rope_type "default" and
    the directory computed other logits."""
    from transformers import AutoModelForCausalLM

    from heron.engine.args import EngineArgs
    from heron.entrypoints.convert import export_hf_directory

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    directory = build_tiny_model(str(tmp_path / "src"), dict(model_type="llama", rope_parameters=rope),
                                 embedded_tokenizer)
    path = str(tmp_path / "llama31.gguf")
    write_tiny_llama_gguf(path, AutoModelForCausalLM.from_pretrained(directory), {})
    config = EngineArgs(model=path, dtype="float32", quantization="none", max_model_len=128).create_engine_config()
    output = export_hf_directory(config, str(tmp_path / "hf"))
    converted = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
    assert {key: converted.config.rope_parameters[key] for key in rope} == rope
    prompt, = random_prompts([90], seed=4)  # past the original context: the scaling shows
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert reference_greedy(converted, prompt, 8) == reference_greedy(reference, prompt, 8)


@pytest.mark.parametrize("types, expected", [
    ({"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_0,
      "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0}, "int4"),
    (dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"], Q.Q8_0), "int8"),
    ({**dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"], Q.Q4_1),
      "ffn_down": Q.Q8_0}, "int8"),
    ({**dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"], Q.Q4_1),
      "ffn_down": Q.F16}, "none"),
])
def test_quantization_auto_follows_the_files_linear_types(tmp_path, embedded_tokenizer, monkeypatch, types, expected):
    """A GGUF of Q4_0/Q4_1 linears loads in int4, which holds those weights
    exactly (each block on the grid of its own type), with Q8_0 among them in
    int8, anything else unquantized; an explicit bf16 or quantization keeps what
    was asked."""
    from transformers import AutoModelForCausalLM

    from heron.engine import resolve
    from heron.engine.args import EngineArgs
    from heron.kernels.cpu import isa

    # the same choice on any CPU: AVX2 kernels, no native bf16 (with it, an unquantized "auto" is bf16: below)
    monkeypatch.setattr(isa, "supported_isas", lambda: ["scalar", "avx2"])
    monkeypatch.setattr(resolve, "cpu_has_native_bf16", lambda: False)
    directory = str(tmp_path / "src")
    build_tiny_model(directory, dict(model_type="llama", intermediate_size=128, hidden_size=128,
                                     num_attention_heads=4, num_key_value_heads=2), embedded_tokenizer)
    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32),
                          {"token_embd": Q.Q8_0, "output": Q.Q6_K, **types})
    config = EngineArgs(model=path, device="cpu", max_model_len=64).create_engine_config()
    assert config.model.quantization == expected
    assert config.model.dtype == torch.float32
    bf16 = EngineArgs(model=path, device="cpu", dtype="bfloat16", max_model_len=64).create_engine_config().model
    assert bf16.quantization == "none"
    no_quant = EngineArgs(model=path, device="cpu", quantization="none", max_model_len=64).create_engine_config().model
    assert no_quant.quantization == "none"
    not_gguf = EngineArgs(model=directory, device="cpu", max_model_len=64).create_engine_config().model
    assert not_gguf.quantization == "none"  # not a GGUF
    monkeypatch.setattr(resolve, "cpu_has_native_bf16", lambda: True)
    native_bf16 = EngineArgs(model=path, device="cpu", max_model_len=64).create_engine_config().model
    assert native_bf16.quantization == expected  # a low-bit file stays low-bit, on float32
    assert native_bf16.dtype == (torch.bfloat16 if expected == "none" else torch.float32)
    monkeypatch.setattr(resolve, "cpu_has_native_bf16", lambda: False)
    if expected == "int4":  # Q4_0 and Q4_1 blocks alike are held exactly (attn_q is Q4_0, attn_k Q4_1)
        llm = LLM(path, max_model_len=64, num_kv_blocks=16)
        reference = LLM(path, quantization="none", dtype="float32", max_model_len=64, num_kv_blocks=16)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            held = llm.engine.engine_core.model_runner.model.layers[0].get_submodule(name).dequantized
            exact = reference.engine.engine_core.model_runner.model.layers[0].get_submodule(name).weight
            assert torch.equal(held, exact), name


def test_quantization_names_are_checked():
    from heron.engine.args import EngineArgs

    with pytest.raises(ValueError, match="quantization must be one of 'auto', 'none', 'int8', 'int4'"):
        EngineArgs(quantization="int3").create_engine_config()
