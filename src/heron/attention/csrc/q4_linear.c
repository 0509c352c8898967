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
 * Decoding reads an eighth of float32's weight bytes. Each block is unpacked and
 * dequantized (w = d * q + m, one FMA) once per group of four input rows; every
 * row then takes four FMAs per block into accumulators of its own (one chain per
 * 8 lanes for a single row, so consecutive blocks do not wait on each other).
 * Output columns are split over OpenMP threads. Layouts (contiguous): x [rows, k], packed [n, k / 2] uint8,
 * scales and mins [n, k / 32] float, y [rows, n]. k must be a multiple of 32.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROW_GROUP 4

#ifndef __AVX2__
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
#endif

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
#ifdef __AVX2__
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *wq = packed + n * (k / 2);
        const float *d = scales + n * nb;
        const float *m = mins + n * nb;
        const __m128i low_mask = _mm_set1_epi8(0x0F);
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_GROUP) {
            int64_t rc = rows - r0 < ROW_GROUP ? rows - r0 : ROW_GROUP;
            /* a single row: four independent chains; several: two per row */
            __m256 acc[ROW_GROUP][2];
            __m256 solo[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int rr = 0; rr < ROW_GROUP; rr++) acc[rr][0] = acc[rr][1] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(wq + b * 16));
                __m128i lo = _mm_and_si128(bytes, low_mask);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
                __m256 dv = _mm256_set1_ps(d[b]), mv = _mm256_set1_ps(m[b]);
                __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv);
                __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv);
                __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
                __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv);
                if (rc == 1) {
                    const float *xp = x + r0 * k + b * 32;
                    solo[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), solo[0]);
                    solo[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8), solo[1]);
                    solo[2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xp + 16), solo[2]);
                    solo[3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xp + 24), solo[3]);
                    continue;
                }
                for (int64_t rr = 0; rr < rc; rr++) {
                    const float *xp = x + (r0 + rr) * k + b * 32;
                    acc[rr][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), acc[rr][0]);
                    acc[rr][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8), acc[rr][1]);
                    acc[rr][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xp + 16), acc[rr][0]);
                    acc[rr][1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xp + 24), acc[rr][1]);
                }
            }
            if (rc == 1) {
                y[r0 * n_out + n] = hsum(_mm256_add_ps(_mm256_add_ps(solo[0], solo[1]), _mm256_add_ps(solo[2], solo[3])));
            } else {
                for (int64_t rr = 0; rr < rc; rr++) y[(r0 + rr) * n_out + n] = hsum(_mm256_add_ps(acc[rr][0], acc[rr][1]));
            }
        }
    }
    return 0;
#else
    float *sums = malloc(sizeof(float) * (size_t)(rows * nb));
    if (sums == NULL) return -2;
    block_sums(x, rows, k, sums);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *wq = packed + n * (k / 2);
        const float *d = scales + n * nb;
        const float *m = mins + n * nb;
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * k;
            float acc = 0.0f, msum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *block = wq + b * 16;
                const float *xp = xr + b * 32;
                float s = 0.0f;
                for (int j = 0; j < 16; j++) s += (float)(block[j] & 0x0F) * xp[j] + (float)(block[j] >> 4) * xp[j + 16];
                acc += d[b] * s;
                msum += m[b] * sums[r * nb + b];
            }
            y[r * n_out + n] = acc + msum;
        }
    }
    free(sums);
    return 0;
#endif
}
