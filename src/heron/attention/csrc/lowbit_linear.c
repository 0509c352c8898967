/*
 * The int8 inputs of heron's low-bit linear layers, and the int4 mode's LM head.
 *
 * Inputs are rounded per row in blocks of 16 (symmetric int8, scale
 * e = max|x| / 127, round to nearest even): x ~ e * p (heron_quantize_input,
 * used by every low-bit kernel; heron_round_q8_f32 returns e * p as floats for
 * torch fallbacks, bit-identical to quantization.py's torch formula). Blocks
 * of 16 rather than llama.cpp's 32 halve the inputs an outlier coarsens: on the
 * embedded model perplexity 32.90 vs 33.13 with 32 (float inputs: 32.95).
 *
 * heron_q8_linear_f32: int8 weights with one float scale per output channel
 * (the int4 mode's LM head, often tied to the embedding and the most sensitive
 * matrix) times those inputs, with integer dot products (AVX2 maddubs/madd; the
 * sign trick makes the weight operand unsigned). The 4-bit layers' kernel is
 * q4_tiled_linear.c.
 *
 * Output columns are split over OpenMP threads. Layouts (contiguous): x [rows, k]
 * float, weights [n, k] int8, scales [n] float, y [rows, n] float; k a multiple of 32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "lowbit_input.h"

#define ACT_BLOCK 16 /* activations: one int8 scale per 16 inputs */

/* x [rows, k] -> p [rows, k] int8; per 32-block: e [rows, nb, 8] (the low half's
 * scale four times, then the high half's: the lanes of signed_block_dot's result) and
 * s [rows, nb] (the block's rounded sum, e0 * sum p[0:16] + e1 * sum p[16:32]) */
static void quantize_block(const float *x, int8_t *p, float *e, float *s) {
    float block_sum = 0.0f;
    for (int half = 0; half < 2; half++) {
        const float *v = x + half * ACT_BLOCK;
        int8_t *q = p + half * ACT_BLOCK;
        float amax = 0.0f;
        int total = 0;
#ifdef __AVX2__
        const __m256 sign = _mm256_set1_ps(-0.0f);
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        /* cvtps rounds to nearest even, as lrintf does in the default mode */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inverse));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inverse));
        const __m256i i16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);  /* 16 x int16, in order */
        const __m128i i8 = _mm_packs_epi16(_mm256_castsi256_si128(i16), _mm256_extracti128_si256(i16, 1));
        _mm_storeu_si128((__m128i *)q, i8);
        __m256i sum = _mm256_add_epi32(i0, i1);
        __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
        total = _mm_cvtsi128_si32(sum4);
#else
        for (int i = 0; i < ACT_BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < ACT_BLOCK; i++) {
            q[i] = (int8_t)lrintf(v[i] * inverse);
            total += q[i];
        }
#endif
        const float scale = amax / 127.0f;
        for (int lane = 0; lane < 4; lane++) e[half * 4 + lane] = scale;
        block_sum += scale * (float)total;
    }
    *s = block_sum;
}

static void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *p, float *e, float *s) {
    const int64_t nb = k / 32;
#pragma omp parallel for schedule(static) if (rows * k >= 8192)
    for (int64_t i = 0; i < rows * nb; i++) {
        const int64_t r = i / nb, b = i % nb;
        quantize_block(x + r * k + b * 32, p + r * k + b * 32, e + i * 8, s + i);
    }
}

void heron_release_input(quantized_input *in) { free(in->p), free(in->e), free(in->s); }

int heron_quantize_input(const float *x, int64_t rows, int64_t k, quantized_input *in) {
    const int64_t nb = k / 32;
    in->p = malloc((size_t)(rows * k));
    in->e = malloc(sizeof(float) * (size_t)(rows * nb * 8));
    in->s = malloc(sizeof(float) * (size_t)(rows * nb));
    if (!in->p || !in->e || !in->s) {
        heron_release_input(in);
        return -2;
    }
    quantize_rows(x, rows, k, in->p, in->e, in->s);
    return 0;
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* sum_i w_i p_i of one block of int8 weights and activations, as 8 int32 partial
 * sums (lanes 0-3 the block's low half, 4-7 its high half, matching e's layout)
 * converted to float: maddubs needs an unsigned operand, so |w| times p with w's sign */
static inline __m256 signed_block_dot(__m256i w, const int8_t *p) {
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                         _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)p), w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

/* y [rows, n] = Q8(x) @ (w * scale)^T for w [n, k] int8 and scale [n] float;
 * |w| <= 127, so maddubs's int16 pairs (at most 2 * 127 * 127) never saturate. */
int heron_q8_linear_f32(const float *x, int64_t rows, int64_t k, const int8_t *weight, const float *weight_scales,
                        float *y, int64_t n_out) {
    if (k % 32 != 0) return -1;
    const int64_t nb = k / 32;
    quantized_input in;
    if (heron_quantize_input(x, rows, k, &in) != 0) return -2;
    const int8_t *p = in.p;
    const float *e = in.e;  /* no minimum term: in.s is unused */
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const int8_t *w = weight + n * k;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *pr = p + r * k;
            const float *er = e + r * nb * 8;
            float total = 0.0f;
#ifdef __AVX2__
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            int64_t b = 0;
            for (; b + 2 <= nb; b += 2) {
                a0 = _mm256_fmadd_ps(signed_block_dot(_mm256_loadu_si256((const __m256i *)(w + b * 32)), pr + b * 32),
                                     _mm256_loadu_ps(er + b * 8), a0);
                a1 = _mm256_fmadd_ps(signed_block_dot(_mm256_loadu_si256((const __m256i *)(w + b * 32 + 32)), pr + b * 32 + 32),
                                     _mm256_loadu_ps(er + b * 8 + 8), a1);
            }
            if (b < nb)
                a0 = _mm256_fmadd_ps(signed_block_dot(_mm256_loadu_si256((const __m256i *)(w + b * 32)), pr + b * 32),
                                     _mm256_loadu_ps(er + b * 8), a0);
            total = hsum(_mm256_add_ps(a0, a1));
#else
            for (int64_t b = 0; b < nb; b++) {
                int32_t low = 0, high = 0;
                for (int j = 0; j < 16; j++) low += w[b * 32 + j] * pr[b * 32 + j], high += w[b * 32 + 16 + j] * pr[b * 32 + 16 + j];
                total += er[b * 8] * (float)low + er[b * 8 + 4] * (float)high;
            }
#endif
            y[r * n_out + n] = total * weight_scales[n];
        }
    }
    heron_release_input(&in);
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
        float e[8], s;
        quantize_block(x + r * k + b * 32, p, e, &s);
        float *o = out + r * k + b * 32;
        for (int j = 0; j < 32; j++) o[j] = (float)p[j] * e[j < ACT_BLOCK ? 0 : 4];
    }
    return 0;
}
