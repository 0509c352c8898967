/*
 * IEEE half precision (float16) for the KV cache: a float16 cache holds half a
 * float32 one's bytes, which is what decode attention reads.
 *
 * heron_float_to_half rounds to nearest, ties to even (as F16C's vcvtps2ph with
 * _MM_FROUND_TO_NEAREST_INT and torch's .half() do), with subnormals, infinities
 * and NaN; heron_half_to_float is exact. The vector builds convert with F16C
 * (part of every build's flags from AVX2 on), so every build stores and reads
 * the same bits.
 */
#ifndef HERON_HALF_H
#define HERON_HALF_H

#include <stdint.h>
#include <string.h>

#include "simd.h"

static inline float heron_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13); /* infinity, NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400u)) m <<= 1, shift++;
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t heron_float_to_half(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude >= 0x7F800000u) /* infinity, or NaN (kept quiet) */
        return sign | 0x7C00u | (magnitude > 0x7F800000u ? 0x200u | ((magnitude >> 13) & 0x3FFu) : 0);
    if (magnitude >= 0x477FF000u) return sign | 0x7C00u; /* rounds past 65504: infinity */
    if (magnitude < 0x38800000u) { /* below half's smallest normal: a subnormal (or zero) */
        if (magnitude < 0x33000000u) return sign; /* under half the smallest subnormal: zero */
        const uint32_t exponent = magnitude >> 23, mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
        const uint32_t shift = 126 - exponent; /* 14..24 */
        uint32_t value = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (value & 1u))) value++;
        return sign | (uint16_t)value;
    }
    uint32_t value = ((magnitude >> 13) - (112u << 10)); /* exponent rebiased, 10 mantissa bits */
    const uint32_t rest = magnitude & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (value & 1u))) value++; /* may carry into the exponent: right */
    return sign | (uint16_t)value;
}

/* dst[i] = half(src[i]) for i < n */
static inline void heron_store_halves(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#if defined(HERON_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = heron_float_to_half(src[i]);
}

#endif
