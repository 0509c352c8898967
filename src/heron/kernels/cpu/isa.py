"""The CPU's vector instruction sets, and which one heron's C kernels use.

heron compiles its kernels once per instruction set it knows (``ISAS``, from
the portable reference to AVX-512 with VNNI) and loads the best one the CPU
has. ``HERON_CPU_ISA`` forces one of them, where the CPU has what it needs;
asking for more than the CPU has is an error, never a silent downgrade.
"""

from __future__ import annotations

import functools
import platform
from typing import Literal

from heron import envs

CpuIsa = Literal["scalar", "avx2", "avx512", "avx512_vnni"]
ISAS: tuple[CpuIsa, ...] = ("scalar", "avx2", "avx512", "avx512_vnni")  # weakest first
ISA_ENV = envs.HERON_CPU_ISA

# /proc/cpuinfo flags each build needs
_REQUIRED_FLAGS: dict[CpuIsa, tuple[str, ...]] = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
}
_AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
_AVX512_FLAGS = [*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"]
# compiler flags of each build: explicit instruction sets (never -march=native), so a
# cached library never holds instructions another CPU sharing the cache lacks
COMPILE_FLAGS: dict[CpuIsa, list[str]] = {
    "scalar": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64", *_AVX2_FLAGS],
    "avx512": ["-march=x86-64", *_AVX512_FLAGS],
    "avx512_vnni": ["-march=x86-64", *_AVX512_FLAGS, "-mavx512vnni"],
}
# features reported beside the ISA (logs, benchmarks): what torch's bf16 GEMMs may use
_REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_isas() -> list[CpuIsa]:
    """The builds this CPU can run, weakest first ("scalar" always)."""
    if not is_x86_64():
        return ["scalar"]
    flags = cpu_flags()
    return [isa for isa in ISAS if all(flag in flags for flag in _REQUIRED_FLAGS[isa])]


def compile_flags(isa: CpuIsa) -> list[str]:
    # other architectures get the portable code at their baseline (NEON on aarch64)
    return COMPILE_FLAGS[isa] if is_x86_64() else []


def selected_isa() -> CpuIsa:
    """``HERON_CPU_ISA`` if set (and not "auto"), else the CPU's best."""
    supported = supported_isas()
    requested = envs.get(ISA_ENV, "auto").strip().lower() or "auto"
    if requested == "auto":
        return supported[-1]
    if requested not in ISAS:
        raise ValueError(f"{ISA_ENV}={requested!r}: choose 'auto' or one of {', '.join(ISAS)}")
    if requested not in supported:
        missing = [flag for flag in _REQUIRED_FLAGS[requested] if flag not in cpu_flags()]
        raise ValueError(
            f"{ISA_ENV}={requested} needs CPU features this CPU lacks ({', '.join(missing) or 'x86-64'}); "
            f"it runs {', '.join(supported)}"
        )
    return requested


def cpu_summary() -> str:
    """The CPU's model name and the vector features that matter to heron."""
    flags = cpu_flags()
    present = [flag for flag in _REPORTED_FLAGS if flag in flags]
    return f"{cpu_model_name()} ({' '.join(present) or 'no AVX2'})"
