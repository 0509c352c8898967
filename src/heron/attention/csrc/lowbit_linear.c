/*
 * Low-bit linear layers for small batches on the CPU, with int8 activations:
 * 4-bit weights (heron_q4_linear_f32, the int4 mode's layers) and int8 weights
 * with one scale per output channel (heron_q8_linear_f32, the int4 mode's LM head).
 *
 * Weights are quantized in blocks of 32 along the input dimension, each block
 * with a float scale d and minimum m (GGUF's Q4_1 scheme): w = d * q + m with
 * q in [0, 15]. A block's 32 nibbles take 16 bytes: byte j holds element j in
 * its low nibble and element j + 16 in its high nibble.
 *
 * Activations are quantized per row in blocks of 16 (symmetric int8, scale
 * e = max|x| / 127, round to nearest even): x ~ e * p. Then per weight block,
 * with e0, e1 the scales of its two activation halves,
 *
 *   sum_i w_i x_i ~ d (e0 sum_{i<16} q_i p_i + e1 sum_{i>=16} q_i p_i) + m (e0 sum_{i<16} p_i + e1 sum_{i>=16} p_i)
 *
 * The integer sums are exact (AVX2: maddubs u8 x s8 -> pairs in int16, at most
 * 2 * 15 * 127, no saturation; madd -> int32, lanes 0-3 holding the low half and
 * 4-7 the high half, so one vector of scales applies both). Blocks of 16 rather
 * than llama.cpp's 32 halve the inputs an outlier coarsens: on the embedded model
 * perplexity 32.90 vs 33.13 with 32 (float inputs: 32.95). The min term uses
 * the *quantized* block sum, so the layer computes exactly W x^ for the rounded
 * activations x^ = e * p (the weights' mean does not amplify the rounding
 * error): the relative error of an output is about 0.5%, far below the 4-bit
 * weights' own. heron's torch path computes the same function for larger
 * batches (activations rounded the same way, then the float32 GEMM), so a
 * request's numerics do not depend on the batch beyond float32 rounding.
 *
 * Why: float32 dequantization (convert, FMA) of every weight made the 4-bit
 * decode compute-bound at about half the DRAM bandwidth; the integer dot takes
 * a third of the instructions, and a batch-1 step now streams the weights at
 * close to the bandwidth.
 *
 * Output columns are split over OpenMP threads. Layouts (contiguous): x [rows, k] float, packed [n, k / 2]
 * uint8, scales and mins [n, k / 32] float, y [rows, n] float. k must be a multiple of 32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ACT_BLOCK 16 /* activations: one int8 scale per 16 inputs */

/* x [rows, k] -> p [rows, k] int8; per 32-block: e [rows, nb, 8] (the low half's
 * scale four times, then the high half's: the lanes of block_dot's result) and
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

/* a batch of rows quantized by quantize_rows, in buffers the caller frees with release_input */
typedef struct {
    int8_t *p;
    float *e, *s;
} quantized_input;

static void release_input(quantized_input *in) { free(in->p), free(in->e), free(in->s); }

/* 0, or -2 when out of memory (nothing left allocated) */
static int quantize_input(const float *x, int64_t rows, int64_t k, quantized_input *in) {
    const int64_t nb = k / 32;
    in->p = malloc((size_t)(rows * k));
    in->e = malloc(sizeof(float) * (size_t)(rows * nb * 8));
    in->s = malloc(sizeof(float) * (size_t)(rows * nb));
    if (!in->p || !in->e || !in->s) {
        release_input(in);
        return -2;
    }
    quantize_rows(x, rows, k, in->p, in->e, in->s);
    return 0;
}

static inline float min_term(const float *m, const float *s, int64_t nb) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t b = 0; b < nb; b++) total += m[b] * s[b];
    return total;
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* the block's 32 nibbles as bytes 0..31 in element order */
static inline __m256i unpack_block(const uint8_t *wq) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)wq);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
}

/* sum_i q_i p_i of one block, as 8 partial int32 sums converted to float */
static inline __m256 block_dot(__m256i w, const int8_t *p) {
    __m256i pairs = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)p));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* one output column for one row; two accumulator chains so blocks overlap */
static float dot_row(const uint8_t *wq, const float *d, const float *m, const int8_t *p, const float *e,
                     const float *s, int64_t nb) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(block_dot(unpack_block(wq + b * 16), p + b * 32), _mm256_loadu_ps(e + b * 8)),
                             _mm256_set1_ps(d[b]), a0);
        a1 = _mm256_fmadd_ps(_mm256_mul_ps(block_dot(unpack_block(wq + b * 16 + 16), p + b * 32 + 32),
                                           _mm256_loadu_ps(e + b * 8 + 8)),
                             _mm256_set1_ps(d[b + 1]), a1);
    }
    if (b < nb)
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(block_dot(unpack_block(wq + b * 16), p + b * 32), _mm256_loadu_ps(e + b * 8)),
                             _mm256_set1_ps(d[b]), a0);
    return hsum(_mm256_add_ps(a0, a1)) + min_term(m, s, nb);
}

/* one output column for four rows: each block is unpacked once */
static void dot_rows4(const uint8_t *wq, const float *d, const float *m, const int8_t *p, const float *e,
                      const float *s, int64_t k, int64_t nb, float *y, int64_t y_stride) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i w = unpack_block(wq + b * 16);
        const __m256 db = _mm256_set1_ps(d[b]);
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(block_dot(w, p + b * 32), _mm256_loadu_ps(e + b * 8)), db, a0);
        a1 = _mm256_fmadd_ps(_mm256_mul_ps(block_dot(w, p + k + b * 32), _mm256_loadu_ps(e + (nb + b) * 8)), db, a1);
        a2 = _mm256_fmadd_ps(_mm256_mul_ps(block_dot(w, p + 2 * k + b * 32), _mm256_loadu_ps(e + (2 * nb + b) * 8)), db, a2);
        a3 = _mm256_fmadd_ps(_mm256_mul_ps(block_dot(w, p + 3 * k + b * 32), _mm256_loadu_ps(e + (3 * nb + b) * 8)), db, a3);
    }
    y[0] = hsum(a0) + min_term(m, s, nb);
    y[y_stride] = hsum(a1) + min_term(m, s + nb, nb);
    y[2 * y_stride] = hsum(a2) + min_term(m, s + 2 * nb, nb);
    y[3 * y_stride] = hsum(a3) + min_term(m, s + 3 * nb, nb);
}
#else
static float dot_row(const uint8_t *wq, const float *d, const float *m, const int8_t *p, const float *e,
                     const float *s, int64_t nb) {
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = wq + b * 16;
        const int8_t *pb = p + b * 32;
        int32_t low = 0, high = 0;
        for (int j = 0; j < 16; j++) low += (block[j] & 0x0F) * pb[j], high += (block[j] >> 4) * pb[j + 16];
        total += d[b] * (e[b * 8] * (float)low + e[b * 8 + 4] * (float)high);
    }
    return total + min_term(m, s, nb);
}
#endif

int heron_q4_linear_f32(const float *x, int64_t rows, int64_t k, const uint8_t *packed, const float *scales,
                        const float *mins, float *y, int64_t n_out) {
    if (k % 32 != 0) return -1;
    const int64_t nb = k / 32;
    quantized_input in;
    if (quantize_input(x, rows, k, &in) != 0) return -2;
    const int8_t *p = in.p;
    const float *e = in.e, *s = in.s;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *wq = packed + n * (k / 2);
        const float *d = scales + n * nb, *m = mins + n * nb;
        int64_t r = 0;
#ifdef __AVX2__
        for (; r + 4 <= rows; r += 4) dot_rows4(wq, d, m, p + r * k, e + r * nb * 8, s + r * nb, k, nb, y + r * n_out + n, n_out);
#endif
        for (; r < rows; r++) y[r * n_out + n] = dot_row(wq, d, m, p + r * k, e + r * nb * 8, s + r * nb, nb);
    }
    release_input(&in);
    return 0;
}

#ifdef __AVX2__
/* sum_i w_i p_i of one block of int8 weights and activations, per lane half as
 * block_dot: maddubs needs an unsigned operand, so |w| times p with w's sign */
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
    if (quantize_input(x, rows, k, &in) != 0) return -2;
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
    release_input(&in);
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
