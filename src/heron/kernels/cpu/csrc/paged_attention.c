/*
 * Paged attention on the CPU, for any query rows: each row (a decode
 * token, or one token of a prefill chunk) attends over its request's K/V up to
 * and including its own position, read in place from the paged cache through
 * the request's block table: no gather into a padded tensor. This step's K/V
 * must be in the cache already, which makes attention causal within a chunk.
 * Work is split over OpenMP threads by sequence (by sequence and KV head when
 * there are few sequences); consecutive rows of one request (a prefill chunk's
 * tokens) share a sequence's task, up to 8, so the vector path loads each cached
 * key and value once for all of them (a 512-token chunk at context 2048: 10-25%
 * faster). A task computes the scores of its query heads against
 * every key, then a softmax (exp vectorized), then the weighted sum of values,
 * all in float32; the cache holds float32 or float16 (half the bytes to read,
 * converted to float32 as loaded). With a task per sequence each cached slot (every KV head) is
 * read as one contiguous run, which the hardware prefetcher follows: reading a
 * third of each slot per task ran at about 7 GB/s.
 *
 * The vector builds (AVX2, AVX-512) take head sizes of 1 to 16 vectors on a
 * path of their own: scores for a vector's width of positions at once (each
 * position's dot product left as a vector of partial sums, then all of them
 * summed across lanes in one shuffle tree: no horizontal sum per dot product),
 * and the values' weighted sums for several query heads held in registers over
 * every position (the output is not loaded and stored once per position).
 * On an AVX-512 EPYC, 30 layers at batch 32 and context 330 went from 39 to
 * 29 ms (float32 cache, BENCHMARKS.md). The portable loops below are the
 * reference and serve any other head size.
 *
 * Layouts (contiguous):
 *   q, out      [num_seqs, num_heads, head_dim]  (a "sequence" is a query row)
 *   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim]  (K then V), float32 or float16
 *   block_table [table rows, max_blocks_per_seq]  int64
 *   table_rows  [num_seqs]  int64: the block-table row of each query row (NULL: row i uses row i)
 *   seq_lens    [num_seqs]  int64 (context length including the query's own token)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "simd.h"

#define MAX_TASK_ROWS 256 /* query heads one task handles: ops.py checks num_heads <= this */

static inline float dot(const float *restrict a, const void *cache, int64_t index, int half, int64_t n) {
    float sum = 0.0f;
    if (!half) {
        const float *restrict b = (const float *)cache + index;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
        return sum;
    }
    const uint16_t *b = (const uint16_t *)cache + index;
    for (int64_t i = 0; i < n; i++) sum += a[i] * heron_half_to_float(b[i]);
    return sum;
}

static inline void axpy(float *restrict y, float alpha, const void *cache, int64_t index, int half, int64_t n) {
    if (!half) {
        const float *restrict x = (const float *)cache + index;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
        return;
    }
    const uint16_t *x = (const uint16_t *)cache + index;
    for (int64_t i = 0; i < n; i++) y[i] += alpha * heron_half_to_float(x[i]);
}

#include "vector_exp.h"

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

#if defined(HERON_AVX2)
/* ---- the vector path: VEC_LANES floats a vector ---- */
#if defined(HERON_AVX512)
#define VEC_LANES 16
#define MAX_ACCUMULATORS 24 /* of 32 zmm registers: the rest hold values and scores */
typedef __m512 vec;
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_zero _mm512_setzero_ps
#define vec_set1 _mm512_set1_ps
#define vec_add _mm512_add_ps
#define vec_mul _mm512_mul_ps
#define vec_fma _mm512_fmadd_ps
#define vec_max _mm512_max_ps

/* lane i = the sum of v[i]'s lanes (a shuffle tree: 45 operations for 16 sums) */
static inline __attribute__((always_inline)) vec sum_each(const vec v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: v[2i]'s and v[2i+1]'s halves summed, interleaved */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's sum of v[4i .. 4i+3], in order */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* across the four 128-bit lanes: quads[i]'s lanes summed become lane group i */
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline float vec_max_of(vec v) { return _mm512_reduce_max_ps(v); }

static inline vec vec_from_halves(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#else
#define VEC_LANES 8
#define MAX_ACCUMULATORS 12 /* of 16 ymm registers */
typedef __m256 vec;
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_zero _mm256_setzero_ps
#define vec_set1 _mm256_set1_ps
#define vec_add _mm256_add_ps
#define vec_mul _mm256_mul_ps
#define vec_fma _mm256_fmadd_ps
#define vec_max _mm256_max_ps

/* lane i = the sum of v[i]'s lanes */
static inline __attribute__((always_inline)) vec sum_each(const vec v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a = (sums of the low halves of v0..v3, of their high halves), b the same for v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline vec vec_from_halves(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline float vec_max_of(vec v) {
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    return best;
}
#endif

/* VEC_LANES elements of a cache from element `index` (half: float16, converted) */
static inline __attribute__((always_inline)) vec kv_load(const void *cache, int64_t index, int half) {
    return half ? vec_from_halves((const uint16_t *)cache + index) : vec_load((const float *)cache + index);
}

/* scores[i] = scale * q . k_i for `count` (<= VEC_LANES) keys k_i at cache element `keys` + i * stride, nv vectors
 * each */
static inline __attribute__((always_inline)) void score_keys(int nv, int half, const float *q, const void *cache,
                                                             int64_t keys, int64_t stride, int count, float scale,
                                                             float *scores) {
    vec query[16], partial[VEC_LANES];
    for (int j = 0; j < nv; j++) query[j] = vec_load(q + j * VEC_LANES);
    for (int i = 0; i < VEC_LANES; i++) {
        if (i < count) {
            const int64_t key = keys + i * stride;
            vec sum = vec_mul(query[0], kv_load(cache, key, half));
            for (int j = 1; j < nv; j++) sum = vec_fma(query[j], kv_load(cache, key + j * VEC_LANES, half), sum);
            partial[i] = sum;
        } else {
            partial[i] = vec_zero();
        }
    }
    const vec sums = vec_mul(sum_each(partial), vec_set1(scale));
    if (count == VEC_LANES) {
        vec_store(scores, sums);
    } else {
        float lanes[VEC_LANES];
        vec_store(lanes, sums);
        memcpy(scores, lanes, sizeof(float) * (size_t)count);
    }
}

/* out[r] += sum over i < run of weights[r * count + i] * v_i, for `rows` (<= 6, and rows * nv <= 24) query heads
 * of one KV head; v_i at cache element `values` + i * stride (nv vectors) */
static inline __attribute__((always_inline)) void weigh_values(int nv, int half, int rows, const float *weights,
                                                               int64_t count, const void *cache, int64_t values,
                                                               int64_t stride, int64_t run, float *out,
                                                               int64_t out_stride) {
    vec acc[24];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < nv; j++) acc[r * nv + j] = vec_load(out + r * out_stride + j * VEC_LANES);
    for (int64_t i = 0; i < run; i++, values += stride) {
        vec value[16];
        for (int j = 0; j < nv; j++) value[j] = kv_load(cache, values + j * VEC_LANES, half);
        for (int r = 0; r < rows; r++) {
            const vec weight = vec_set1(weights[r * count + i]);
            for (int j = 0; j < nv; j++) acc[r * nv + j] = vec_fma(weight, value[j], acc[r * nv + j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < nv; j++) vec_store(out + r * out_stride + j * VEC_LANES, acc[r * nv + j]);
}

/* ask for the cache lines of `bytes` from `start` (the next block, while this one is worked on: blocks lie
 * anywhere in the pool, so the hardware prefetcher cannot guess them) */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char *)start + offset, _MM_HINT_T0);
}

/* the positions [pos, pos + run) that lie in one block and at most `limit` of them; their first slot */
static inline int64_t block_run(int64_t pos, int64_t length, int64_t limit, int64_t block_size) {
    int64_t run = block_size - pos % block_size;
    if (run > length - pos) run = length - pos;
    return run < limit ? run : limit;
}

/* one task on the vector path: `tokens` consecutive query rows of one request (a prefill chunk's tokens, or one
 * row), the last at context `length`, the one before at length - 1 and so on, over some of its KV heads. Each key
 * and value vector is loaded for all of them while it is in the L1 cache, so a chunk of T tokens reads the
 * cached context once instead of T times. nv = head_dim / VEC_LANES and half (the cache holds float16) are
 * constants after inlining; K at cache element 0, V at v_offset; token t's queries and outputs are at
 * t * token_stride from the first's */
static inline __attribute__((always_inline)) void attend_task(
    int nv, int half, float *outputs, const float *queries, const void *cache, int64_t v_offset,
    const int64_t *blocks, int64_t start, int64_t length, int64_t tokens, int64_t token_stride, int64_t heads,
    int64_t group, int64_t head_dim, int64_t block_size, int64_t block_stride, int64_t slot_stride,
    int64_t first_head, float scale, float *scores) {
    const int64_t count = length - start, rows = heads * group; /* rows: query heads of one token */
    const int64_t element_size = half ? 2 : 4, block_bytes = block_stride * element_size;
    /* scores: a vector's width of positions at a time (never across a block), every token's query heads; a
     * token's row ends at its own position (the positions after it are the chunk's later tokens) */
    for (int64_t pos = start; pos < length;) {
        const int64_t chunk = block_run(pos, length, VEC_LANES, block_size);
        if (pos % block_size + chunk == block_size && pos + chunk < length)
            prefetch_bytes((const char *)cache + blocks[pos / block_size + 1] * block_bytes, block_bytes);
        const int64_t slots = blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride +
                              first_head * head_dim;
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t own_length = length - (tokens - 1 - t);
            if (pos >= own_length) continue; /* past this token's own position: only later tokens see it */
            const int64_t own_chunk = chunk < own_length - pos ? chunk : own_length - pos;
            for (int64_t row = 0; row < rows; row++)
                score_keys(nv, half, queries + t * token_stride + row * head_dim, cache,
                           slots + (row / group) * head_dim, slot_stride, (int)own_chunk, scale,
                           scores + (t * rows + row) * count + (pos - start));
        }
        pos += chunk;
    }
    /* softmax weights per query head of each token, over its own positions (nothing reads past them) */
    float sums[MAX_TASK_ROWS];
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t own_count = count - (tokens - 1 - t);
        for (int64_t row = t * rows; row < (t + 1) * rows; row++) {
            float *s = scores + row * count;
            vec best = vec_set1(-INFINITY);
            int64_t i = 0;
            for (; i + VEC_LANES <= own_count; i += VEC_LANES) best = vec_max(best, vec_load(s + i));
            float maximum = vec_max_of(best);
            for (; i < own_count; i++) maximum = s[i] > maximum ? s[i] : maximum;
            sums[row] = exp_and_sum(s, own_count, maximum);
        }
        memset(outputs + t * token_stride, 0, sizeof(float) * (size_t)(rows * head_dim));
    }
    /* weighted values, a block at a time (read whole, as written); per token and KV head, as many of its query
     * heads at once as registers hold */
    const int max_rows = nv >= MAX_ACCUMULATORS ? 1 : (MAX_ACCUMULATORS / nv > 6 ? 6 : MAX_ACCUMULATORS / nv);
    for (int64_t pos = start; pos < length;) {
        const int64_t run = block_run(pos, length, block_size, block_size);
        if (pos + run < length)
            prefetch_bytes((const char *)cache + (v_offset + blocks[pos / block_size + 1] * block_stride) * element_size,
                           block_bytes);
        const int64_t slots = v_offset + blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride;
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t own_length = length - (tokens - 1 - t);
            if (pos >= own_length) continue;
            const int64_t own_run = run < own_length - pos ? run : own_length - pos;
            for (int64_t h = 0; h < heads; h++) {
                for (int64_t g = 0; g < group; g += max_rows) {
                    const int64_t row = h * group + g;
                    const int rows_now = (int)(group - g < max_rows ? group - g : max_rows);
                    const float *weights = scores + (t * rows + row) * count + (pos - start);
                    const int64_t values = slots + (first_head + h) * head_dim;
                    float *out = outputs + t * token_stride + row * head_dim;
#define WEIGH(R) weigh_values(nv, half, R, weights, count, cache, values, slot_stride, own_run, out, head_dim)
                    switch (rows_now) {
                        case 1: WEIGH(1); break;
                        case 2: WEIGH(2); break;
                        case 3: WEIGH(3); break;
                        case 4: WEIGH(4); break;
                        case 5: WEIGH(5); break;
                        case 6: WEIGH(6); break;
                        default: break; /* unreachable: rows_now <= max_rows <= 6 */
                    }
#undef WEIGH
                }
            }
        }
        pos += run;
    }
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t row = 0; row < rows; row++) {
            const vec inverse = vec_set1(1.0f / sums[t * rows + row]);
            float *out = outputs + t * token_stride + row * head_dim;
            for (int j = 0; j < nv; j++) vec_store(out + j * VEC_LANES, vec_mul(vec_load(out + j * VEC_LANES), inverse));
        }
    }
}

/* whether the vector path takes this head size (1 to 16 vectors, a power of two; 16 only on AVX2) */
static int vector_path_takes(int64_t head_dim) {
    if (head_dim % VEC_LANES != 0) return 0;
    const int64_t nv = head_dim / VEC_LANES;
#if defined(HERON_AVX512)
    return nv == 1 || nv == 2 || nv == 4 || nv == 8;
#else
    return nv == 1 || nv == 2 || nv == 4 || nv == 8 || nv == 16;
#endif
}

/* the vector path, for a head size it takes (vector_path_takes) */
static void attend_task_vectors(int half, float *outputs, const float *queries, const void *cache, int64_t v_offset,
                               const int64_t *blocks, int64_t start, int64_t length, int64_t tokens,
                               int64_t token_stride, int64_t heads, int64_t group, int64_t head_dim,
                               int64_t block_size, int64_t block_stride, int64_t slot_stride, int64_t first_head,
                               float scale, float *scores) {
#define ATTEND(NV, HALF) attend_task(NV, HALF, outputs, queries, cache, v_offset, blocks, start, length, tokens, \
                                     token_stride, heads, group, head_dim, block_size, block_stride, slot_stride, \
                                     first_head, scale, scores)
#define ATTEND_EITHER(NV) \
    if (half) ATTEND(NV, 1); else ATTEND(NV, 0); \
    return
    switch (head_dim / VEC_LANES) {
        case 1: ATTEND_EITHER(1);
        case 2: ATTEND_EITHER(2);
        case 4: ATTEND_EITHER(4);
        case 8: ATTEND_EITHER(8);
#if !defined(HERON_AVX512)
        case 16: ATTEND_EITHER(16);
#endif
        default: break; /* unreachable: the caller asked vector_path_takes */
    }
#undef ATTEND_EITHER
#undef ATTEND
}
#endif

/* the query rows in groups that share a task: [groups[g], groups[g + 1]) are consecutive tokens of one request
 * (the same block-table row, each one position after the last), at most max_tokens of them; returns the number
 * of groups (`groups` holds num_seqs + 1 entries). Rows of their own block-table row each (table_rows NULL) are
 * groups of one. */
static int64_t group_rows(int64_t *groups, const int64_t *table_rows, const int64_t *seq_lens, int64_t num_seqs,
                          int64_t max_tokens) {
    int64_t num_groups = 0;
    for (int64_t row = 0; row < num_seqs; row++) {
        if (row == 0 || table_rows == NULL || row - groups[num_groups - 1] >= max_tokens ||
            table_rows[row] != table_rows[row - 1] || seq_lens[row] != seq_lens[row - 1] + 1)
            groups[num_groups++] = row;
    }
    groups[num_groups] = num_seqs;
    return num_groups;
}

#define MAX_GROUP_TOKENS 8 /* a task's tokens: enough to read a block once for a chunk's worth, scores stay small */

/* kv_half: the cache holds float16 (else float32) */
int heron_paged_attention_f32(
    float *out, const float *q, const void *kv_cache, const int64_t *block_table, const int64_t *table_rows,
    const int64_t *seq_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_blocks, int64_t max_blocks_per_seq, float scale, int64_t sliding_window, int64_t kv_half) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * slot_stride;
    const int64_t v_offset = num_blocks * block_stride; /* V after K, in elements */
    const int64_t token_stride = num_heads * head_dim;  /* from one query row to the next */
    const int half = kv_half != 0;
    int failed = 0;

#if defined(HERON_AVX2)
    const int vector_path = vector_path_takes(head_dim);
#else
    const int vector_path = 0;
#endif
    /* a sliding window starts each token's keys elsewhere, and the portable path takes one token: one token a task
     * there */
    int64_t max_tokens = MAX_TASK_ROWS / num_heads < MAX_GROUP_TOKENS ? MAX_TASK_ROWS / num_heads : MAX_GROUP_TOKENS;
    if (sliding_window > 0 || max_tokens < 1 || !vector_path) max_tokens = 1;
    int64_t *groups = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (groups == NULL) return -1;
    const int64_t num_groups = group_rows(groups, table_rows, seq_lens, num_seqs, max_tokens);
    /* many groups: one task per group reads each cached slot (all KV heads)
     * as one contiguous run; few: one per (group, KV head), so both cores work */
    const int64_t heads_per_task = num_groups >= 8 ? num_kv_heads : 1;
    const int64_t tasks_per_group = num_kv_heads / heads_per_task;
#pragma omp parallel
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_groups * tasks_per_group; task++) {
            const int64_t first_row = groups[task / tasks_per_group];
            const int64_t tokens = groups[task / tasks_per_group + 1] - first_row;
            const int64_t first_head = (task % tasks_per_group) * heads_per_task;
            const int64_t rows = heads_per_task * group * tokens; /* query heads of this task */
            const int64_t last = first_row + tokens - 1;         /* the group's longest row */
            const int64_t length = seq_lens[last];
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
            const int64_t *blocks = block_table + (table_rows ? table_rows[last] : last) * max_blocks_per_seq;
            const float *queries = q + first_row * token_stride + first_head * group * head_dim;
            float *outputs = out + first_row * token_stride + first_head * group * head_dim;
#if defined(HERON_AVX2)
            if (vector_path) {
                attend_task_vectors(half, outputs, queries, kv_cache, v_offset, blocks, start, length, tokens,
                                    token_stride, heads_per_task, group, head_dim, block_size, block_stride,
                                    slot_stride, first_head, scale, scores);
                continue;
            }
#endif
            /* the portable reference (and any head size the vector path does not take): one token per task */
            float maxima[MAX_TASK_ROWS];
            for (int64_t row = 0; row < rows; row++) maxima[row] = -INFINITY;
            for (int64_t pos = start; pos < length; pos++) {
                const int64_t slot = blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride
                                     + first_head * head_dim;
                for (int64_t row = 0; row < rows; row++) {
                    const float s =
                        dot(queries + row * head_dim, kv_cache, slot + (row / group) * head_dim, half, head_dim) * scale;
                    scores[row * count + (pos - start)] = s;
                    if (s > maxima[row]) maxima[row] = s;
                }
            }
            float sums[MAX_TASK_ROWS];
            for (int64_t row = 0; row < rows; row++) sums[row] = exp_and_sum(scores + row * count, count, maxima[row]);
            memset(outputs, 0, sizeof(float) * rows * head_dim);
            for (int64_t pos = start; pos < length; pos++) {
                const int64_t slot = v_offset + blocks[pos / block_size] * block_stride +
                                     (pos % block_size) * slot_stride + first_head * head_dim;
                for (int64_t row = 0; row < rows; row++)
                    axpy(outputs + row * head_dim, scores[row * count + (pos - start)], kv_cache,
                         slot + (row / group) * head_dim, half, head_dim);
            }
            for (int64_t row = 0; row < rows; row++) {
                const float inverse = 1.0f / sums[row];
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) outputs[row * head_dim + i] *= inverse;
            }
        }
        free(scores);
    }
    free(groups);
    return failed ? -1 : 0;
}

/* dst[i] = float16(src[i]), as the native forward pass stores K/V in a float16 cache (for tests) */
int heron_store_halves_f32(uint16_t *dst, const float *src, int64_t n) {
    heron_store_halves(dst, src, n);
    return 0;
}
