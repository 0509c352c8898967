/*
 * Paged attention for decode steps on the CPU (float32).
 *
 * One query token per sequence attends over that sequence's K/V, read in place
 * from the paged cache through its block table: no gather into a padded tensor.
 * Work is split over (sequence, KV head) pairs with OpenMP; each pair computes
 * the scores of its query heads (the GQA group) against every key once, then a
 * softmax, then the weighted sum of values, all in float32. Loops over the head
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

#pragma omp parallel
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
            const int64_t seq = task / num_kv_heads;
            const int64_t kv_head = task % num_kv_heads;
            const int64_t length = seq_lens[seq];
            const int64_t start = (sliding_window > 0 && length > sliding_window) ? length - sliding_window : 0;
            const int64_t count = length - start;
            if (count * group > capacity) {
                free(scores);
                capacity = count * group;
                scores = (float *)malloc(sizeof(float) * capacity);
                if (scores == NULL) {
                    failed = 1;
                    capacity = 0;
                    continue;
                }
            }
            const int64_t *blocks = block_table + seq * max_blocks_per_seq;
            const float *queries = q + (seq * num_heads + kv_head * group) * head_dim;
            float *outputs = out + (seq * num_heads + kv_head * group) * head_dim;
            float maxima[64];
            float sums[64];
            for (int64_t g = 0; g < group; g++) maxima[g] = -INFINITY, sums[g] = 0.0f;
            for (int64_t pos = start; pos < length; pos++) {
                const float *key = k_cache + blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride
                                   + kv_head * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float s = dot(queries + g * head_dim, key, head_dim) * scale;
                    scores[g * count + (pos - start)] = s;
                    if (s > maxima[g]) maxima[g] = s;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *row = scores + g * count;
                float total = 0.0f;
                for (int64_t i = 0; i < count; i++) {
                    row[i] = expf(row[i] - maxima[g]);
                    total += row[i];
                }
                sums[g] = total;
                memset(outputs + g * head_dim, 0, sizeof(float) * head_dim);
            }
            for (int64_t pos = start; pos < length; pos++) {
                const float *value = v_cache + blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride
                                     + kv_head * head_dim;
                for (int64_t g = 0; g < group; g++)
                    axpy(outputs + g * head_dim, scores[g * count + (pos - start)], value, head_dim);
            }
            for (int64_t g = 0; g < group; g++) {
                const float inverse = 1.0f / sums[g];
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) outputs[g * head_dim + i] *= inverse;
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
