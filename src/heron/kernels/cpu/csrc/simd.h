/*
 * Which vector instructions a build of heron's CPU kernels uses.
 *
 * kernels/cpu/isa.py compiles the same sources once per instruction set, with
 * that set's compiler flags, and loads the build the CPU (or HERON_CPU_ISA)
 * chooses at run time. The flags decide which of these are defined:
 *
 *   HERON_AVX2         AVX2 + FMA: 256-bit integer dot products (maddubs)
 *   HERON_AVX512       also AVX-512 F/BW/VL/DQ: 512-bit vectors, two column tiles at once
 *   HERON_AVX512_VNNI  also AVX512-VNNI: vpdpbusd (u8 x s8, four products summed into int32)
 *   none of them       portable C: the scalar reference every other build is tested against
 *
 * HERON_EMULATE_AVX512 (1: AVX-512, 2: with VNNI) builds the AVX-512 code for a
 * CPU that lacks it, through SIMDe's portable implementations of the
 * intrinsics: how the tests check that code on any machine.
 *
 * Every build computes the low-bit linear layers and the input rounding bit for
 * bit alike (integer sums are exact, and each output's float operations run in
 * one order everywhere); attention differs by float32 summation order.
 */
#ifndef HERON_SIMD_H
#define HERON_SIMD_H

#if defined(HERON_EMULATE_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define HERON_AVX2 1
#define HERON_AVX512 1
#if HERON_EMULATE_AVX512 >= 2
#define HERON_AVX512_VNNI 1
#endif
#else
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HERON_AVX2 1
#endif
#if defined(HERON_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define HERON_AVX512 1
#endif
#if defined(HERON_AVX512) && defined(__AVX512VNNI__)
#define HERON_AVX512_VNNI 1
#endif
#endif

/* the instruction set this build was compiled for, as isa.py names it */
#if defined(HERON_AVX512_VNNI)
#define HERON_ISA_NAME "avx512_vnni"
#elif defined(HERON_AVX512)
#define HERON_ISA_NAME "avx512"
#elif defined(HERON_AVX2)
#define HERON_ISA_NAME "avx2"
#else
#define HERON_ISA_NAME "scalar"
#endif

#endif
