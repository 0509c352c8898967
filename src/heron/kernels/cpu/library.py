"""Building and loading heron's CPU kernel library: the C files in ``csrc/``,
compiled with the system C compiler on first use (seconds per instruction
set: README, "Instruction sets"), cached, and called through ctypes.

They need no torch headers: kernels take raw pointers to contiguous tensors.
OpenMP threading shares torch's runtime (torch's CPU build loads ``libgomp.so.1``
first, and the kernel library links the same soname). Without a C compiler the
kernels are unavailable and callers fall back to torch ops; set
``HERON_DISABLE_NATIVE=1`` to force that. Which build runs is ``isa.selected_isa()``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

from heron import envs
from heron.kernels.cpu.isa import CpuIsa, compile_flags, cpu_summary, selected_isa
from heron.tempdirs import make_private_dir, remove_private_dir

logger = logging.getLogger(__name__)

SOURCES = ("paged_attention.c", "lowbit_input.c", "tiled_linear.c", "llama_forward.c", "quantize_weights.c")
HEADERS = ("lowbit_input.h", "simd.h", "vector_exp.h", "half.h")
_BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
DISABLE_ENV = envs.HERON_DISABLE_NATIVE


class KernelBuildError(RuntimeError):
    """The C compiler rejected the kernel sources."""


def _cache_dir() -> str:
    return envs.cache_dir("kernels")


def _compiler() -> list[str] | None:
    """The compiler command: ``$CC`` split as a shell would (``ccache gcc``,
    ``gcc -m64``), else cc or gcc; None without one. A ``$CC`` naming no program
    is a RuntimeError (the torch fallbacks, with a warning; it was a
    FileNotFoundError traceback)."""
    given = os.environ.get("CC")
    if given:
        try:
            command = shlex.split(given)
        except ValueError as exc:  # an unclosed quote: the message named no CC
            raise RuntimeError(f"CC={given!r} cannot be read as a command: {exc}") from exc
        if not command or shutil.which(command[0]) is None:
            raise RuntimeError(f"CC={given!r} names no program on this machine")
        return command
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _build(compiler: list[str], flags: list[str], source_dir: str | None = None) -> str:
    """The path of the library built with ``flags`` from ``source_dir`` (default:
    this package's ``csrc``), compiling it unless cached (keyed by the sources too).
    Where the cache cannot be written (a read-only home in a container), the
    library is built into a temporary directory for this process, with a warning."""
    package = resources.files("heron.kernels.cpu").joinpath("csrc") if source_dir is None else Path(source_dir)
    files = [package.joinpath(name) for name in SOURCES + HEADERS]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    digest.update(" ".join([*compiler, *flags]).encode())
    target_dir = os.path.join(_cache_dir(), digest.hexdigest()[:16])
    target = os.path.join(target_dir, "libheron_cpu.so")
    if _is_whole(target):
        with contextlib.suppress(OSError):
            os.utime(target_dir)  # in use: the newest are the ones pruning keeps
        return target
    # a private directory (not tempfile's): one a killed process leaves is swept by the next heron
    scratch = make_private_dir("heron-kernels-")
    logger.info("building the CPU kernels for this version and instruction set (once; seconds)")
    try:
        target = _compile_into(scratch, compiler, flags, files, target_dir, target, digest.hexdigest()[:16])
    finally:
        remove_private_dir(scratch)
    return target


def _compile_into(scratch: str, compiler: list[str], flags: list[str], files: list[Any], target_dir: str,
                  target: str, name: str) -> str:
    """Compile ``files`` in ``scratch`` and install the library at ``target``
    (or, where the cache cannot be written, in this process's private directory)."""
    for file in files:
        with open(os.path.join(scratch, file.name), "wb") as handle:
            handle.write(file.read_bytes())
    partial = os.path.join(scratch, "libheron_cpu.so")
    sources = [os.path.join(scratch, source) for source in SOURCES]
    try:
        result = subprocess.run([*compiler, *flags, *sources, "-o", partial, "-lm"], capture_output=True,
                                text=True)
    except OSError as exc:  # the compiler could not be run at all
        raise KernelBuildError(f"{' '.join(compiler)}: {exc}") from exc
    if result.returncode != 0:  # a compiler that says nothing (CC=false) is named with its status
        raise KernelBuildError(result.stderr[-2000:].strip() or
                               f"{' '.join(compiler)} exited with status {result.returncode}, saying nothing")
    try:
        os.makedirs(target_dir, exist_ok=True)
        _install(partial, target)
        _prune(_cache_dir(), KEPT_BUILDS)
    except OSError as exc:
        target = os.path.join(_private_dir(), f"{name}.so")
        _install(partial, target)
        logger.warning("cannot write the kernel cache (%s); this build is kept in %s until the process exits "
                       "(set HERON_CACHE_DIR to a writable directory to keep builds between starts)", exc, target)
    return target


# builds kept in the cache (one per source version, compiler and instruction set: about 220 KB each); every
# upgrade or edit of the kernels added one, for ever
KEPT_BUILDS = 16


def _prune(cache_dir: str, keep: int) -> None:
    """Remove all but the ``keep`` most recently built or used builds. (A process
    that loaded a removed one keeps its mapping; one about to load it finds it
    gone and builds it again.)"""
    with contextlib.suppress(OSError):
        builds = [entry for entry in os.scandir(cache_dir) if entry.is_dir(follow_symlinks=False)]
        builds.sort(key=lambda entry: entry.stat().st_mtime, reverse=True)
        for entry in builds[keep:]:
            shutil.rmtree(entry.path, ignore_errors=True)


def _install(built: str, target: str) -> None:
    """Put the library ``built`` (in a scratch directory) at ``target``: copied
    beside it, synced, then renamed, so concurrent builders never see half a
    file even where the scratch directory is on another file system (a tmpfs
    /tmp), across which a rename fails; then its digest beside it, which marks
    it whole (``_is_whole``)."""
    with open(built, "rb") as handle:
        data = handle.read()
    for path, content in ((target, data), (_digest_path(target), hashlib.sha256(data).hexdigest().encode())):
        partial = f"{path}.{os.getpid()}.partial"
        try:
            with open(partial, "wb") as handle:
                handle.write(content)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise


def _digest_path(target: str) -> str:
    return f"{target}.sha256"


def _is_whole(target: str) -> bool:
    """Whether a cached library is the one its build wrote: a file cut short (a
    crash before it reached the disk) killed every start that loaded it, with a
    SIGBUS, until someone found and deleted it; such a file is built again."""
    try:
        with open(target, "rb") as handle:
            data = handle.read()
        with open(_digest_path(target), "rb") as handle:
            expected = handle.read().decode("ascii", errors="replace").strip()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == expected


@functools.cache
def _private_dir() -> str:
    """A directory for this process's kernel builds when the cache cannot be
    written, removed at exit."""
    directory = make_private_dir("heron-kernels-")
    atexit.register(remove_private_dir, directory)
    return directory


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """Give the library's entry points their ctypes signatures."""
    attention = library.heron_paged_attention_f32
    attention.restype = ctypes.c_int
    attention.argtypes = [*[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 7, ctypes.c_float, ctypes.c_int64, ctypes.c_int64]
    q4 = library.heron_q4_linear_f32
    q4.restype = ctypes.c_int
    q4.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int64]
    q8 = library.heron_q8_linear_f32
    q8.restype = ctypes.c_int
    q8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 3, ctypes.c_int64]
    rounding = library.heron_round_q8_f32
    rounding.restype = ctypes.c_int
    rounding.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    pack = library.heron_pack_q4_tiles
    pack.restype = ctypes.c_int
    pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 3]
    pack8 = library.heron_pack_q8_tiles
    pack8.restype = ctypes.c_int
    pack8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 2]
    halves = library.heron_store_halves_f32
    halves.restype = ctypes.c_int
    halves.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    library.heron_kernel_isa.restype = ctypes.c_char_p
    library.heron_kernel_isa.argtypes = []
    return library


@functools.cache
def load_library(isa: CpuIsa, emulate_with: str | None = None, source_dir: str | None = None) -> ctypes.CDLL:
    """The kernels built for ``isa``. ``emulate_with``: the include directory of
    SIMDe, to build the AVX-512 code for a CPU without it (tests only: slow).
    ``source_dir``: another tree's ``csrc`` to build instead of this package's
    (benchmarks compare two versions of the kernels in one process).
    Raises KernelBuildError when the compiler fails, RuntimeError without one."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    if emulate_with is None:
        flags = [*_BASE_FLAGS, *compile_flags(isa)]
    else:
        level = {"avx512": 1, "avx512_vnni": 2}[isa]
        flags = [*_BASE_FLAGS, *compile_flags("avx2"), f"-DHERON_EMULATE_AVX512={level}", "-isystem", emulate_with]
    return _declare(ctypes.CDLL(_build(compiler, flags, source_dir)))


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The kernel library for the selected instruction set, or None (logged
    once) when there is no C compiler or it fails. A ``HERON_CPU_ISA`` the CPU
    cannot run raises ValueError."""
    if envs.is_set(DISABLE_ENV):
        return None
    isa = selected_isa()
    try:
        library = load_library(isa)
    except KernelBuildError as exc:
        logger.warning("building native CPU kernels failed; using torch fallbacks:\n%s", exc)
        return None
    except RuntimeError as exc:
        logger.warning("%s: native CPU kernels disabled (slower torch fallbacks)", exc)
        return None
    except OSError as exc:  # no room to build, or a cache on a noexec mount: the library does not map
        logger.warning("the native CPU kernels cannot be built or loaded (%s): slower torch fallbacks (set "
                       "HERON_CACHE_DIR to a writable directory that may hold programs)", exc)
        return None
    logger.info("CPU kernels: %s build on %s", isa, cpu_summary())
    return library


def native_isa() -> str | None:
    """The instruction set the loaded kernels use, or None without them."""
    library = native_library()
    return None if library is None else library.heron_kernel_isa().decode()
