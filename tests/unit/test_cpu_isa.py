"""Every build of heron's CPU kernels against the portable (scalar) build.

The builds this CPU runs are checked natively; the AVX-512 builds a CPU lacks
are checked through SIMDe's portable intrinsics (same source, emulated), so
their code is tested on every machine. The low-bit linear kernels and the input
rounding must match the scalar build bit for bit; paged attention within float32
summation-order rounding (rtol and atol 1e-5)."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

from heron.kernels.cpu import isa as cpu_isa
from heron.kernels.cpu import ops
from heron.kernels.cpu.library import _BASE_FLAGS, _build, load_library
from heron.models.quantization import Int4WeightOnlyLinear, Int8WeightInt8InputLinear

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


def _simde_include() -> str | None:
    try:
        import simde_py
    except ImportError:
        return None
    return simde_py.get_include()


def _variants() -> list[pytest.param]:
    """(name, loader) for every non-scalar build this machine can run, natively or emulated."""
    supported = cpu_isa.supported_isas()
    variants = []
    for isa in cpu_isa.ISAS[1:]:
        if isa in supported:
            variants.append(pytest.param((isa, None), id=isa))
        elif isa.startswith("avx512") and "avx2" in supported:
            include = _simde_include()
            marks = pytest.mark.skipif(include is None, reason="simde-py is not installed")
            variants.append(pytest.param((isa, include), id=f"{isa}-emulated", marks=marks))
    return variants


@pytest.fixture(scope="module")
def scalar() -> ctypes.CDLL:
    return load_library("scalar")


@pytest.fixture(params=_variants())
def variant(request) -> ctypes.CDLL:
    isa, emulate_with = request.param
    library = load_library(isa, emulate_with)
    assert library.heron_kernel_isa().decode() == isa
    return library


def test_scalar_build_is_portable(scalar):
    assert scalar.heron_kernel_isa() == b"scalar"


# (out_features, in_features): odd tile counts leave AVX-512's last tile unpaired
@pytest.mark.parametrize("shape", [(40, 64), (64, 96), (8, 32), (200, 576)])
def test_int4_linear_is_bit_identical_to_scalar(scalar, variant, shape):
    generator = torch.Generator().manual_seed(shape[0])
    layer = Int4WeightOnlyLinear(torch.randn(*shape, generator=generator) * 0.05)
    # single tiles up to 5 rows in AVX-512 builds, then pairs; groups of 4 (each remainder after a whole group,
    # on both paths), panels of 64
    for rows in (1, 2, 3, 4, 5, 6, 7, 9, 65, 70):
        x = torch.randn(rows, shape[1], generator=generator)
        x[0, :16] = 0.0  # an all-zero half block
        x[-1, 3] = 30.0  # an outlier
        expected = ops.q4_linear(x, layer.tiles, layer.scales, layer.mins, library=scalar)
        got = ops.q4_linear(x, layer.tiles, layer.scales, layer.mins, library=variant)
        assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("shape", [(24, 64), (128, 96), (8, 32)])
def test_int8_linear_is_bit_identical_to_scalar(scalar, variant, shape):
    generator = torch.Generator().manual_seed(shape[0] + 1)
    weight = torch.randn(*shape, generator=generator)
    weight[1] *= 40  # per-column scales
    weight[2, :5] = 0.0  # zero weights: the sign trick must give 0
    layer = Int8WeightInt8InputLinear(weight)
    for rows in (1, 2, 3, 5, 7, 9, 66, 67):  # as above: every remainder of a group of 4 on both paths
        x = torch.randn(rows, shape[1], generator=generator)
        x[0, 7] = -50.0
        expected = ops.q8_linear(x, layer.tiles, layer.scales, library=scalar)
        got = ops.q8_linear(x, layer.tiles, layer.scales, library=variant)
        assert torch.equal(got, expected), (got - expected).abs().max()


def test_input_rounding_is_bit_identical_to_scalar(scalar, variant):
    for seed in range(5):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(9, 512, generator=generator) * torch.rand(512, generator=generator) * 5
        x[0, :32] = 0.0
        x[1, 40] = 1e-38  # a block whose scale would overflow: zeros
        x[2, 64:80] = torch.tensor([19.5 / 127 * 3.0] * 15 + [3.0])  # ties round to even
        assert torch.equal(ops.round_q8(x, library=variant), ops.round_q8(x, library=scalar))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (16, 2, 128), (4, 4, 32), (6, 2, 24)])
@pytest.mark.parametrize("num_seqs", [3, 9])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_paged_attention_matches_scalar(scalar, variant, num_heads, num_kv_heads, head_dim, num_seqs, cache_dtype):
    generator = torch.Generator().manual_seed(num_heads * num_seqs)
    num_blocks, block_size, max_blocks = 40, 16, 8
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    seq_lens = torch.tensor([1, 17, 31, 128, 100, 2, 64, 15, 90][:num_seqs], dtype=torch.int64)
    block_table = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in range(num_seqs)])
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator) * 3  # peaked softmax
    for window in (None, 20):
        expected = ops.paged_decode_attention(query, cache, block_table, seq_lens, head_dim**-0.5, window,
                                              library=scalar)
        got = ops.paged_decode_attention(query, cache, block_table, seq_lens, head_dim**-0.5, window, library=variant)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (16, 2, 128), (6, 2, 24), (64, 8, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_paged_attention_of_chunk_tokens_matches_scalar(scalar, variant, num_heads, num_kv_heads, head_dim,
                                                         cache_dtype):
    """Query rows that are consecutive tokens of one request (a prefill chunk
    over cached context, which the vector builds attend in groups that read each
    block once) beside decode rows of other requests, in any build as in the
    scalar one, with and without a sliding window."""
    generator = torch.Generator().manual_seed(num_heads + head_dim)
    num_blocks, block_size, max_blocks = 64, 16, 16
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    block_table = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in range(4)])
    # request 0: a decode at 40; request 1: 19 chunk tokens at 181..199; request 2: a decode; request 3: 3 tokens
    lengths = [[40], list(range(181, 200)), [7], [1, 2, 3]]
    table_rows = torch.tensor([r for r, row in enumerate(lengths) for _ in row], dtype=torch.int64)
    seq_lens = torch.tensor([n for row in lengths for n in row], dtype=torch.int64)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator) * 3
    for window in (None, 20):
        expected = ops.paged_decode_attention(query, cache, block_table, seq_lens, head_dim**-0.5, window,
                                              library=scalar, table_rows=table_rows)
        got = ops.paged_decode_attention(query, cache, block_table, seq_lens, head_dim**-0.5, window,
                                         library=variant, table_rows=table_rows)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_float16_rounding_matches_torch(scalar, variant):
    """The float16 a KV cache gets from the native forward pass: round to nearest
    even, as torch's .half(), on every build (F16C in the vector ones, portable C in
    the scalar one and for the vector builds' tails), subnormals and overflow included."""
    generator = torch.Generator().manual_seed(7)
    x = torch.cat([
        torch.randn(4099, generator=generator) * torch.logspace(-9, 5, 4099),  # every magnitude
        torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14,
                      float("inf"), -float("inf"), 1 + 2.0**-11, 1 + 3 * 2.0**-11]),  # limits and ties
        torch.arange(-(2**15), 2**15, dtype=torch.int16).view(torch.float16).float(),  # every float16 value
    ])
    finite = torch.isfinite(x) | torch.isinf(x)
    expected = x.half().view(torch.int16)
    for library in (scalar, variant):
        got = ops.to_half(x, library=library).view(torch.int16)
        assert torch.equal(got[finite], expected[finite])
        assert torch.isnan(ops.to_half(x, library=library)[~finite]).all()


@pytest.mark.skipif(not cpu_isa.is_x86_64(), reason="x86-64 instruction sets")
@pytest.mark.parametrize("isa", cpu_isa.ISAS)
def test_every_build_compiles_with_the_real_intrinsics(isa):
    """The native build of each instruction set compiles here (running it needs the CPU)."""
    from heron.kernels.cpu.library import _compiler

    _build(_compiler(), [*_BASE_FLAGS, *cpu_isa.compile_flags(isa)])


@pytest.mark.skipif("avx2" not in cpu_isa.supported_isas(), reason="the emulation builds on AVX2")
@pytest.mark.skipif(_simde_include() is None, reason="simde-py is not installed")
@pytest.mark.parametrize("isa", ["avx512", "avx512_vnni"])
def test_every_emulated_build_compiles_here_too(isa):
    """The SIMDe build that checks the AVX-512 code on AVX2-only CPUs compiles on
    every CPU, so a CPU that runs AVX-512 natively (and so never uses it) still
    catches what breaks it (SIMDe's headers bring <complex.h>, whose `I` once broke
    llama_forward.c there only)."""
    assert load_library(isa, _simde_include()).heron_kernel_isa().decode() == isa


def test_forcing_an_isa(monkeypatch):
    supported = cpu_isa.supported_isas()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "scalar")
    assert cpu_isa.selected_isa() == "scalar"
    monkeypatch.setenv(cpu_isa.ISA_ENV, "auto")
    assert cpu_isa.selected_isa() == supported[-1]
    monkeypatch.setenv(cpu_isa.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="HERON_CPU_ISA='sse9'"):
        cpu_isa.selected_isa()
    missing = [isa for isa in cpu_isa.ISAS if isa not in supported]
    if missing:  # never a silent downgrade
        monkeypatch.setenv(cpu_isa.ISA_ENV, missing[0])
        with pytest.raises(ValueError, match="lacks"):
            cpu_isa.selected_isa()


def test_a_bad_isa_is_not_blamed_on_the_packed_cache(tmp_path, monkeypatch, caplog):
    """An HERON_CPU_ISA the machine cannot run is the user's error: said as such,
    before the packed-layer cache, which used to call its entry damaged first."""
    from torch import nn

    from heron.kernels.cpu.library import native_library
    from heron.models.packed_cache import load_packed

    monkeypatch.setenv(cpu_isa.ISA_ENV, "sse9")
    native_library.cache_clear()
    try:
        with caplog.at_level("WARNING"), pytest.raises(ValueError, match="HERON_CPU_ISA='sse9'"):
            load_packed(nn.Linear(32, 8), str(tmp_path / "entry.safetensors"))
    finally:
        monkeypatch.delenv(cpu_isa.ISA_ENV)
        native_library.cache_clear()
    assert "ignoring the cached packed layers" not in caplog.text


def test_flags_name_each_build():
    assert "-mavx512vnni" in cpu_isa.COMPILE_FLAGS["avx512_vnni"]
    assert not any("avx" in flag for flag in cpu_isa.COMPILE_FLAGS["scalar"])
    assert all("native" not in flag for flags in cpu_isa.COMPILE_FLAGS.values() for flag in flags)


def test_a_cache_that_cannot_be_written_still_gives_a_library(tmp_path, monkeypatch, caplog):
    """A read-only home (a locked-down container) must not stop heron: the build
    goes to a directory of this process's own, with a warning that says so."""
    from heron.kernels.cpu.library import _compiler

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HERON_CACHE_DIR", str(blocker / "cache"))
    flags = [*_BASE_FLAGS, *cpu_isa.compile_flags("scalar")]
    with caplog.at_level("WARNING", logger="heron.kernels.cpu.library"):
        path = _build(_compiler(), flags)
    assert not path.startswith(str(blocker)) and os.path.exists(path)
    assert "cannot write the kernel cache" in caplog.text and "HERON_CACHE_DIR" in caplog.text
    library = ctypes.CDLL(path)
    library.heron_kernel_isa.restype = ctypes.c_char_p
    assert library.heron_kernel_isa() == b"scalar"


def test_a_scratch_directory_on_another_file_system_still_fills_the_cache(tmp_path, monkeypatch, caplog):
    """A tmpfs /tmp: a rename from the scratch directory into the cache fails
    (EXDEV), as simulated here for any rename between two directories; the build
    still lands in the cache, without a warning."""
    import errno

    from heron.kernels.cpu import library

    real_replace = os.replace

    def replace_within_one_directory(source, destination):
        if os.path.dirname(os.fspath(source)) != os.path.dirname(os.fspath(destination)):
            raise OSError(errno.EXDEV, "Invalid cross-device link", source)
        real_replace(source, destination)

    monkeypatch.setattr(library.os, "replace", replace_within_one_directory)
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="heron.kernels.cpu.library"):
        path = library._build(library._compiler(), [*_BASE_FLAGS, *cpu_isa.compile_flags("scalar")])
    assert path.startswith(str(tmp_path / "cache" / "kernels")) and os.path.exists(path)
    assert "cannot write the kernel cache" not in caplog.text
    assert sorted(os.listdir(os.path.dirname(path))) == ["libheron_cpu.so", "libheron_cpu.so.sha256"]  # no partial


def test_a_cached_library_cut_short_is_built_again(tmp_path, monkeypatch):
    """A library cut short in the cache (a crash before it reached the disk)
    killed every later start with a SIGBUS in dlopen, until someone deleted it."""
    from heron.kernels.cpu.library import _compiler

    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path))
    flags = [*_BASE_FLAGS, *cpu_isa.compile_flags("scalar")]
    path = _build(_compiler(), flags)
    whole = os.path.getsize(path)
    for damage in (lambda: os.truncate(path, 1000), lambda: os.truncate(path, 0), lambda: os.remove(f"{path}.sha256")):
        damage()
        assert _build(_compiler(), flags) == path and os.path.getsize(path) == whole
    library = ctypes.CDLL(path)
    library.heron_kernel_isa.restype = ctypes.c_char_p
    assert library.heron_kernel_isa() == b"scalar"


def fresh_native_library(caplog):
    """``native_library()`` looked for again (its caches cleared before and
    after: a library built already would not look for the compiler again), its
    warnings in ``caplog``."""
    from heron.kernels.cpu import library

    library.native_library.cache_clear()
    library.load_library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="heron.kernels.cpu.library"):
            return library.native_library()
    finally:
        library.native_library.cache_clear()
        library.load_library.cache_clear()


@pytest.mark.parametrize("compiler, works", [("/nonexistent/cc", False), ("cc -m64", True), ("", True)])
def test_cc_is_split_as_a_shell_would_and_a_missing_one_falls_back(compiler, works, monkeypatch, caplog):
    """CC="gcc -m64" (or "ccache gcc") and a CC naming no program were
    FileNotFoundError tracebacks at start, where the torch fallbacks were promised."""
    import shutil

    from heron.kernels.cpu import library

    if shutil.which("cc") is None:
        pytest.skip("no cc here")
    monkeypatch.setenv("CC", compiler)
    if works:
        assert library._compiler() == (compiler.split() or [shutil.which("cc")])
        return
    assert fresh_native_library(caplog) is None
    assert "names no program" in caplog.text and "torch fallbacks" in caplog.text


@pytest.mark.parametrize("failure, said", [
    ("noexec", "cannot be built or loaded"),  # a cache on a noexec mount: the library does not map
    ("unclosed quote", "cannot be read as a command"),  # CC='gcc "x': a ValueError naming no CC
    ("silent compiler", "exited with status 1, saying nothing"),  # CC=false: the reason was empty
])
def test_a_kernel_library_that_cannot_be_had_falls_back_saying_why(failure, said, tmp_path, monkeypatch, caplog):
    """Each was a traceback at start (or a warning with no reason), where the
    torch fallbacks with a warning are promised."""
    import shutil
    import tempfile

    from heron.kernels.cpu import library

    if shutil.which("cc") is None:
        pytest.skip("no cc here")
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the scratch build goes
    if failure == "noexec":
        def unmappable(path, *args, **kwargs):
            raise OSError(f"{path}: failed to map segment from shared object")

        monkeypatch.setattr(library.ctypes, "CDLL", unmappable)
    else:
        monkeypatch.setenv("CC", 'gcc "x' if failure == "unclosed quote" else "false")
    assert fresh_native_library(caplog) is None
    assert said in caplog.text and "torch fallbacks" in caplog.text, caplog.text
    assert not [p for p in os.listdir(tmp_path) if p.startswith("heron-kernels-")]  # the scratch build is gone
    if failure == "noexec":
        assert os.listdir(tmp_path / "cache" / "kernels")  # it was built, in the cache, before the load failed
