/*
 * Paged attention for decode steps on the CPU (float32).
 *
 * One query token per sequence attends over that sequence's K/V, read in place
 * from the paged cache through its block table: no gather into a padded tensor.
 * Work is split over OpenMP threads by sequence (by sequence and KV head when
 * there are few sequences); a task computes the scores of its query heads against
 * every key, then a softmax (exp vectorized), then the weighted sum of values,
 * all in float32. With a task per sequence each cached slot (every KV head) is
 * read as one contiguous run, which the hardware prefetcher follows: reading a
 * third of each slot per task ran at about 7 GB/s. Loops over the head
 * dimension are written so the compiler vectorizes them (-O3 -march=native).
 *
 * Layouts (contiguous):
 *   q, out      [num_seqs, num_heads, head_dim]
 *   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim]  (K then V)
 *   block_table [num_seqs, max_blocks_per_seq]  int64
 *   seq_lens    [num_seqs]  int64 (context length including the new token)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_TASK_ROWS 256 /* query heads one task handles: ops.py checks num_heads <= this */

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline void axpy(float *restrict y, float alpha, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}

#if defined(HERON_AVX2)
/* e^x for x <= 0 (scores minus their maximum), 8 lanes: x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error under
 * 2e-7, about libm's), times 2^n built in the exponent bits; below -87 it
 * returns 0 (e^-87 is under float's normal range). */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.0f);
    const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lowest);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts: exact n * hi */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}
#endif

/* row[i] = e^(row[i] - maximum); returns their sum */
static float exp_and_sum(float *row, int64_t count, float maximum) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(HERON_AVX2)
    const __m256 shift = _mm256_set1_ps(maximum);
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= count; i += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i), shift));
        _mm256_storeu_ps(row + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int lane = 0; lane < 8; lane++) total += lanes[lane];
#endif
    for (; i < count; i++) {
        row[i] = expf(row[i] - maximum);
        total += row[i];
    }
    return total;
}

int heron_paged_decode_attention_f32(
    float *out, const float *q, const float *kv_cache, const int64_t *block_table, const int64_t *seq_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_blocks, int64_t max_blocks_per_seq, float scale, int64_t sliding_window) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * slot_stride;
    const float *k_cache = kv_cache;
    const float *v_cache = kv_cache + num_blocks * block_stride;
    int failed = 0;

    /* many sequences: one task per sequence reads each cached slot (all KV heads)
     * as one contiguous run; few: one per (sequence, KV head), so both cores work */
    const int64_t heads_per_task = num_seqs >= 8 ? num_kv_heads : 1;
    const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
#pragma omp parallel
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * tasks_per_seq; task++) {
            const int64_t seq = task / tasks_per_seq;
            const int64_t first_head = (task % tasks_per_seq) * heads_per_task;
            const int64_t rows = heads_per_task * group; /* query heads of this task */
            const int64_t length = seq_lens[seq];
            const int64_t start = (sliding_window > 0 && length > sliding_window) ? length - sliding_window : 0;
            const int64_t count = length - start;
            if (count * rows > capacity) {
                free(scores);
                capacity = count * rows;
                scores = (float *)malloc(sizeof(float) * capacity);
                if (scores == NULL) {
#pragma omp atomic write
                    failed = 1;
                    capacity = 0;
                    continue;
                }
            }
            const int64_t *blocks = block_table + seq * max_blocks_per_seq;
            const float *queries = q + (seq * num_heads + first_head * group) * head_dim;
            float *outputs = out + (seq * num_heads + first_head * group) * head_dim;
            float maxima[MAX_TASK_ROWS];
            for (int64_t row = 0; row < rows; row++) maxima[row] = -INFINITY;
            for (int64_t pos = start; pos < length; pos++) {
                const float *slot = k_cache + blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride
                                    + first_head * head_dim;
                for (int64_t row = 0; row < rows; row++) {
                    const float s = dot(queries + row * head_dim, slot + (row / group) * head_dim, head_dim) * scale;
                    scores[row * count + (pos - start)] = s;
                    if (s > maxima[row]) maxima[row] = s;
                }
            }
            float sums[MAX_TASK_ROWS];
            for (int64_t row = 0; row < rows; row++) sums[row] = exp_and_sum(scores + row * count, count, maxima[row]);
            memset(outputs, 0, sizeof(float) * rows * head_dim);
            for (int64_t pos = start; pos < length; pos++) {
                const float *slot = v_cache + blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride
                                    + first_head * head_dim;
                for (int64_t row = 0; row < rows; row++)
                    axpy(outputs + row * head_dim, scores[row * count + (pos - start)], slot + (row / group) * head_dim,
                         head_dim);
            }
            for (int64_t row = 0; row < rows; row++) {
                const float inverse = 1.0f / sums[row];
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) outputs[row * head_dim + i] *= inverse;
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
