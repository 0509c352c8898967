/*
 * The int8 inputs of heron's low-bit linear layers (tiled_linear.c).
 *
 * Inputs are rounded per row in blocks of 16 (symmetric int8, scale
 * e = max|x| / 127, round to nearest even): x ~ e * p (heron_quantize_input;
 * heron_round_q8_f32 returns e * p as floats for the torch fallback,
 * bit-identical to quantization.py's torch formula). Blocks of 16 rather than
 * llama.cpp's 32 halve the inputs an outlier coarsens: on the embedded model
 * perplexity 32.90 vs 33.13 with 32 (float inputs: 32.95).
 *
 * Layouts (contiguous): x [rows, k] float, k a multiple of 32; the output's in lowbit_input.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lowbit_input.h"
#include "simd.h"

#define ACT_BLOCK 16 /* activations: one int8 scale per 16 inputs */
/* blocks whose largest magnitude is below this round to zeros: 127 / amax would
 * overflow to inf near float's smallest normals (quantization.py uses the same bound) */
#define MIN_BLOCK_MAX 1e-30f

#if defined(HERON_AVX2)
static inline float max8(__m256 m) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

static inline int sum8(__m256i s) {
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
    return _mm_cvtsi128_si32(sum4);
}
#endif

/* one block of 32 inputs x -> p[0:32] int8, e[0:2] (each half's scale) and s (the
 * block's rounded sum, e0 * sum p[0:16] + e1 * sum p[16:32]) */
static void quantize_block(const float *x, int8_t *p, float *e, float *s) {
    float block_sum = 0.0f;
    for (int half = 0; half < 2; half++) {
        const float *v = x + half * ACT_BLOCK;
        int8_t *q = p + half * ACT_BLOCK;
        float amax = 0.0f;
        int total = 0;
#if defined(HERON_AVX512)
        const __m512 v16 = _mm512_loadu_ps(v);
        const __m512 magnitude = _mm512_abs_ps(v16);
        amax = max8(_mm256_max_ps(_mm512_castps512_ps256(magnitude), _mm512_extractf32x8_ps(magnitude, 1)));
        const __m512 inverse = _mm512_set1_ps(amax >= MIN_BLOCK_MAX ? 127.0f / amax : 0.0f);
        const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(v16, inverse)); /* nearest even, as lrintf */
        _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(rounded));
        total = sum8(_mm256_add_epi32(_mm512_castsi512_si256(rounded), _mm512_extracti64x4_epi64(rounded, 1)));
#elif defined(HERON_AVX2)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        amax = max8(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)));
        const __m256 inverse = _mm256_set1_ps(amax >= MIN_BLOCK_MAX ? 127.0f / amax : 0.0f);
        /* cvtps rounds to nearest even, as lrintf does in the default mode */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inverse));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inverse));
        const __m256i i16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);  /* 16 x int16, in order */
        const __m128i i8 = _mm_packs_epi16(_mm256_castsi256_si128(i16), _mm256_extracti128_si256(i16, 1));
        _mm_storeu_si128((__m128i *)q, i8);
        total = sum8(_mm256_add_epi32(i0, i1));
#else
        for (int i = 0; i < ACT_BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float inverse = amax >= MIN_BLOCK_MAX ? 127.0f / amax : 0.0f;
        for (int i = 0; i < ACT_BLOCK; i++) {
            q[i] = (int8_t)lrintf(v[i] * inverse);
            total += q[i];
        }
#endif
        const float scale = amax / 127.0f;
        e[half] = scale;
        block_sum += scale * (float)total;
    }
    *s = block_sum;
}

static void quantize_rows(const float *x, int64_t rows, int64_t k, quantized_input *in) {
    const int64_t nb = k / 32, groups = (rows + INPUT_GROUP_ROWS - 1) / INPUT_GROUP_ROWS;
    if (rows % INPUT_GROUP_ROWS != 0) { /* the last group's missing rows: never read, zeroed to be defined */
        memset(in->p + (groups - 1) * nb * INPUT_BLOCK_BYTES, 0, (size_t)(nb * INPUT_BLOCK_BYTES));
        memset(in->e + (groups - 1) * nb * INPUT_BLOCK_SCALES, 0, sizeof(float) * (size_t)(nb * INPUT_BLOCK_SCALES));
        memset(in->s + (groups - 1) * nb * INPUT_GROUP_ROWS, 0, sizeof(float) * (size_t)(nb * INPUT_GROUP_ROWS));
    }
#pragma omp parallel for schedule(static) if (rows * k >= 8192)
    for (int64_t i = 0; i < rows * nb; i++) {
        const int64_t r = i / nb, b = i % nb, row = r % INPUT_GROUP_ROWS;
        const int64_t block = (r / INPUT_GROUP_ROWS) * nb + b;
        int8_t p[32];
        float e[2];
        quantize_block(x + r * k + b * 32, p, e, in->s + block * INPUT_GROUP_ROWS + row);
        int8_t *out = in->p + block * INPUT_BLOCK_BYTES + row * 4;
        for (int j = 0; j < 8; j++) memcpy(out + (j / 4) * 64 + (j % 4) * 16, p + 4 * j, 4);
        for (int half = 0; half < 2; half++) in->e[block * INPUT_BLOCK_SCALES + half * INPUT_GROUP_ROWS + row] = e[half];
    }
}

void heron_release_input(quantized_input *in) { free(in->p), free(in->e), free(in->s); }

int heron_quantize_input(const float *x, int64_t rows, int64_t k, quantized_input *in) {
    const int64_t nb = k / 32, groups = (rows + INPUT_GROUP_ROWS - 1) / INPUT_GROUP_ROWS;
    in->p = malloc((size_t)(groups * nb * INPUT_BLOCK_BYTES));
    in->e = malloc(sizeof(float) * (size_t)(groups * nb * INPUT_BLOCK_SCALES));
    in->s = malloc(sizeof(float) * (size_t)(groups * nb * INPUT_GROUP_ROWS));
    if (!in->p || !in->e || !in->s) {
        heron_release_input(in);
        return -2;
    }
    quantize_rows(x, rows, k, in);
    return 0;
}

/* out [rows, k] = the activations as the kernel rounds them (e * p): the torch
 * path's input for batches too large for the kernel, so both compute one function. */
int heron_round_q8_f32(const float *x, int64_t rows, int64_t k, float *out) {
    if (k % 32 != 0) return -1;
    const int64_t nb = k / 32;
#pragma omp parallel for schedule(static) if (rows * k >= 65536)
    for (int64_t i = 0; i < rows * nb; i++) {
        const int64_t r = i / nb, b = i % nb;
        int8_t p[32];
        float e[2], s;
        quantize_block(x + r * k + b * 32, p, e, &s);
        float *o = out + r * k + b * 32;
        for (int j = 0; j < 32; j++) o[j] = (float)p[j] * e[j / ACT_BLOCK];
    }
    return 0;
}
