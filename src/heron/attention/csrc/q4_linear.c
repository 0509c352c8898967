/*
 * 4-bit weight-only linear layer for small batches on the CPU (float32 math).
 *
 * Weights are quantized in blocks of 32 along the input dimension, each block
 * with a float scale d and minimum m (GGUF's Q4_1 scheme): w = d * q + m with
 * q in [0, 15]. A block's 32 nibbles take 16 bytes: byte j holds element j in
 * its low nibble and element j + 16 in its high nibble.
 *
 *   y[r, n] = sum_b d[n, b] * sum_i q[n, b, i] * x[r, 32 b + i] + m[n, b] * sum_i x[r, 32 b + i]
 *
 * Decoding reads an eighth of float32's weight bytes; each block is unpacked
 * once and used for up to four input rows. Output columns are split over
 * OpenMP threads. Layouts (contiguous): x [rows, k], packed [n, k / 2] uint8,
 * scales and mins [n, k / 32] float, y [rows, n]. k must be a multiple of 32.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROW_GROUP 4

static void block_sums(const float *x, int64_t rows, int64_t k, float *sums) {
    int64_t nb = k / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + r * k + b * 32;
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s += p[i];
            sums[r * nb + b] = s;
        }
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

int heron_q4_linear_f32(const float *x, int64_t rows, int64_t k, const uint8_t *packed, const float *scales,
                        const float *mins, float *y, int64_t n_out) {
    if (k % 32 != 0) return -1;
    int64_t nb = k / 32;
    float *sums = malloc(sizeof(float) * (size_t)(rows * nb));
    if (sums == NULL) return -2;
    block_sums(x, rows, k, sums);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *wq = packed + n * (k / 2);
        const float *d = scales + n * nb;
        const float *m = mins + n * nb;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_GROUP) {
            int64_t rc = rows - r0 < ROW_GROUP ? rows - r0 : ROW_GROUP;
            float msum[ROW_GROUP] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef __AVX2__
            __m256 acc[ROW_GROUP];
            for (int rr = 0; rr < ROW_GROUP; rr++) acc[rr] = _mm256_setzero_ps();
            const __m128i low_mask = _mm_set1_epi8(0x0F);
            for (int64_t b = 0; b < nb; b++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(wq + b * 16));
                __m128i lo = _mm_and_si128(bytes, low_mask);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
                __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                __m256 dv = _mm256_set1_ps(d[b]);
                for (int64_t rr = 0; rr < rc; rr++) {
                    const float *xp = x + (r0 + rr) * k + b * 32;
                    __m256 s = _mm256_mul_ps(q0, _mm256_loadu_ps(xp));
                    s = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp + 8), s);
                    s = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xp + 16), s);
                    s = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xp + 24), s);
                    acc[rr] = _mm256_fmadd_ps(dv, s, acc[rr]);
                    msum[rr] += m[b] * sums[(r0 + rr) * nb + b];
                }
            }
            for (int64_t rr = 0; rr < rc; rr++) y[(r0 + rr) * n_out + n] = hsum(acc[rr]) + msum[rr];
#else
            float acc[ROW_GROUP] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *block = wq + b * 16;
                for (int64_t rr = 0; rr < rc; rr++) {
                    const float *xp = x + (r0 + rr) * k + b * 32;
                    float s = 0.0f;
                    for (int j = 0; j < 16; j++) s += (float)(block[j] & 0x0F) * xp[j] + (float)(block[j] >> 4) * xp[j + 16];
                    acc[rr] += d[b] * s;
                    msum[rr] += m[b] * sums[(r0 + rr) * nb + b];
                }
            }
            for (int64_t rr = 0; rr < rc; rr++) y[(r0 + rr) * n_out + n] = acc[rr] + msum[rr];
#endif
        }
    }
    free(sums);
    return 0;
}
