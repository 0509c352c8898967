/*
 * A whole Llama forward pass on the CPU in one call: every layer of a low-bit
 * model (4-bit Q4_1-scheme or int8 linear layers, int8 inputs) over a flat
 * batch of tokens, any mix of decodes and prefill chunks.
 *
 * The torch path spends about half of a small model's decode step between its
 * matrix products: ~20 small torch ops per layer (norms, RoPE, the K/V write,
 * residual adds, SiLU) plus Python, each costing more in dispatch than in
 * arithmetic, and its prompts go through torch's attention, which gathers each
 * request's cached K/V first. Here those are plain loops over the rows (split
 * over threads when there are many), and the matrix products are the same C
 * kernels the torch path calls (heron_q4_linear_f32 / heron_q8_linear_f32);
 * attention is heron_paged_attention_f32 for every row, each over its request's
 * cache up to its own position. Both paths compute one function; they differ
 * by float32 rounding, which the int8 rounding of each linear layer's input now
 * and then turns into one rounding step.
 *
 * Per layer, for hidden states h [T, hidden]:
 *   x = rmsnorm(h) * w_in;  qkv = x Wqkv^T;  RoPE on q and k;  k, v -> cache slots
 *   h += attention(q) Wo^T      (after every row's k, v is in the cache)
 *   x = rmsnorm(h) * w_post;  g, u = x Wgu^T;  h += (silu(g) * u) Wdown^T
 * and at the end h = rmsnorm(h) * w_final, in place. The last layer runs its attention and MLP only for the rows
 * whose output is read (the rows sampled), where the caller names them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "vector_exp.h"

/* row loops go over threads from this many rows on (below, the fork costs more than it saves) */
#define PARALLEL_ROWS 16

int heron_q4_linear_f32(const float *x, int64_t rows, int64_t k, const uint8_t *tiles, const float *scales,
                        const float *mins, float *y, int64_t n_out);
int heron_q8_linear_f32(const float *x, int64_t rows, int64_t k, const int8_t *tiles, const float *column_scales,
                        float *y, int64_t n_out);
int heron_paged_attention_f32(float *out, const float *q, const void *kv_cache, const int64_t *block_table,
                              const int64_t *table_rows, const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                              int64_t max_blocks_per_seq, float scale, int64_t sliding_window, int64_t kv_half);

typedef struct {         // column tiles, see tiled_linear.c
    const void *tiles;    // bits 4: [n / 8, k / 32, 128] uint8; bits 8: [n / 8, k / 4, 32] int8
    const float *scales;  // bits 4: [n / 8, k / 32, 8]; bits 8: [n] (one per column)
    const float *mins;    // bits 4: [n / 8, k / 32, 8]; bits 8: unused
    int64_t bits;         // 4 or 8
} heron_lowbit_weight;

typedef struct {
    const float *input_norm;  // [hidden]
    const float *post_norm;   // [hidden]
    heron_lowbit_weight qkv;      // n = (heads + 2 kv_heads) * head_dim, k = hidden
    heron_lowbit_weight o;        // n = hidden, k = heads * head_dim
    heron_lowbit_weight gate_up;  // n = 2 intermediate, k = hidden
    heron_lowbit_weight down;     // n = hidden, k = intermediate
    void *kv_cache;           // [2, num_blocks, block_size, kv_heads, head_dim], float32 or float16
    int64_t sliding_window;   // 0: none
} heron_decoder_layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    int64_t kv_half;  // the KV cache holds float16 (else float32)
} heron_llama_shape;

static void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += row[i] * row[i];
        const float inverse = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[r * n + i] = weight[i] * (row[i] * inverse);
    }
}

/* x * cos + rotate_half(x) * signed_sin, rotate_half(x) = (x2, x1) with the signs
 * already in signed_sin (first half negative), as the torch path computes it. */
static void rope(float *head, const float *cos, const float *signed_sin, int64_t dim) {
    const int64_t half = dim / 2;
    float rotated[512];
    for (int64_t i = 0; i < half; i++) rotated[i] = head[i + half], rotated[i + half] = head[i];
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) head[i] = head[i] * cos[i] + rotated[i] * signed_sin[i];
}

/* out[i] = silu(gate[i]) * up[i] = gate[i] * sigmoid(gate[i]) * up[i] */
static void silu_and_mul(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
#if defined(HERON_AVX2)
    /* sigmoid(x) = 1 / (1 + t) for x >= 0, t / (1 + t) below, with t = e^-|x| (exp of a non-positive number) */
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        const __m256 t = exp_nonpositive(_mm256_or_ps(x, sign)); /* e^-|x| */
        const __m256 numerator = _mm256_blendv_ps(one, t, x);   /* t where x is negative (sign bit set) */
        const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, t));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* hidden += update, [rows, n] */
static void add_rows(float *hidden, const float *update, int64_t rows, int64_t n) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) hidden[r * n + i] += update[r * n + i];
    }
}

static int linear(const heron_lowbit_weight *w, const float *x, int64_t rows, int64_t k, float *y, int64_t n) {
    if (w->bits == 8) return heron_q8_linear_f32(x, rows, k, w->tiles, w->scales, y, n);
    return heron_q4_linear_f32(x, rows, k, w->tiles, w->scales, w->mins, y, n);
}

/* What every layer of one step shares: the model's shape, the step's cache layout and scratch buffers. */
typedef struct {
    heron_llama_shape shape;
    const int64_t *block_table;
    int64_t max_blocks, block_size, num_blocks;
    float *normed, *attended, *gate_up, *activated, *update;
} forward_step;

/* The rest of a layer once every row's k, v is in the cache, over `rows` rows (all of the step's, or the ones
 * whose output is read): attention of their queries, o, the residual add, the MLP, the residual add. */
static int finish_layer(const forward_step *step, const heron_decoder_layer *layer, float *hidden, int64_t rows,
                        const float *queries, const int64_t *table_rows, const int64_t *seq_lens) {
    const heron_llama_shape shape = step->shape;
    const int64_t H = shape.hidden, inter = shape.intermediate, q_size = shape.num_heads * shape.head_dim;
    int status = heron_paged_attention_f32(step->attended, queries, layer->kv_cache, step->block_table, table_rows,
                                           seq_lens, rows, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                           step->block_size, step->num_blocks, step->max_blocks, shape.scale,
                                           layer->sliding_window, shape.kv_half);
    if (status != 0) return status;
    if ((status = linear(&layer->o, step->attended, rows, q_size, step->update, H)) != 0) return status;
    add_rows(hidden, step->update, rows, H);
    rms_norm(hidden, layer->post_norm, step->normed, rows, H, shape.eps);
    if ((status = linear(&layer->gate_up, step->normed, rows, H, step->gate_up, 2 * inter)) != 0) return status;
    float *gate_up = step->gate_up, *activated = step->activated;
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        silu_and_mul(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, activated + r * inter, inter);
    if ((status = linear(&layer->down, activated, rows, inter, step->update, H)) != 0) return status;
    add_rows(hidden, step->update, rows, H);
    return 0;
}

/* The last layer past its k, v over the `num_kept` rows whose output is read (`kept`, strictly increasing): they
 * move to the front of hidden and queries (row kept[i] to row i, never over a row still to move), run there,
 * are final-normed and move back. A prompt chunk's other rows need only their k, v, already in the cache: this
 * skips most of a layer for them (about 1 / num_layers of a prefill). */
static int finish_kept_rows(const forward_step *step, const heron_decoder_layer *layer, const float *final_norm,
                            float *hidden, float *queries, const int64_t *table_rows, const int64_t *seq_lens,
                            const int64_t *kept, int64_t num_kept) {
    const int64_t H = step->shape.hidden, q_size = step->shape.num_heads * step->shape.head_dim;
    if (num_kept == 0) return 0;  // a prompt chunk short of the prompt's end: nothing is read
    int64_t *kept_table_rows = malloc(sizeof(int64_t) * (size_t)num_kept);
    int64_t *kept_seq_lens = malloc(sizeof(int64_t) * (size_t)num_kept);
    int status = kept_table_rows && kept_seq_lens ? 0 : -2;
    for (int64_t i = 0; i < num_kept && status == 0; i++) {
        const int64_t r = kept[i];
        if (r < i || (i > 0 && r <= kept[i - 1])) {
            status = -4;  // not strictly increasing (or out of range): moving the rows would overwrite some
            break;
        }
        memmove(hidden + i * H, hidden + r * H, sizeof(float) * (size_t)H);
        memmove(queries + i * q_size, queries + r * q_size, sizeof(float) * (size_t)q_size);
        kept_table_rows[i] = table_rows ? table_rows[r] : r;
        kept_seq_lens[i] = seq_lens[r];
    }
    if (status == 0) status = finish_layer(step, layer, hidden, num_kept, queries, kept_table_rows, kept_seq_lens);
    if (status == 0) {
        rms_norm(hidden, final_norm, step->normed, num_kept, H, step->shape.eps);
        for (int64_t i = num_kept - 1; i >= 0; i--)
            memcpy(hidden + kept[i] * H, step->normed + i * H, sizeof(float) * (size_t)H);
    }
    free(kept_table_rows), free(kept_seq_lens);
    return status;
}

/* hidden [rows, shape.hidden]: the embeddings of the step's tokens in, the final-normed states out (with `kept`,
 * only in those rows: the others are left unspecified). cos / signed_sin [rows, head_dim]; slots [rows];
 * block_table [requests, max_blocks]; table_rows [rows]: each token's request (its block-table row; NULL: token i
 * is request i's only one); seq_lens [rows]: each token's position + 1 (the context it attends over, itself
 * included); kept [num_kept]: the rows whose output is read, strictly increasing (NULL: all); all int64. */
int heron_llama_forward_lowbit(float *hidden, int64_t rows, const heron_decoder_layer *layers, int64_t num_layers,
                               const float *final_norm, heron_llama_shape shape, const float *cos,
                               const float *signed_sin, const int64_t *slots, const int64_t *block_table,
                               int64_t max_blocks, const int64_t *table_rows, const int64_t *seq_lens,
                               int64_t block_size, int64_t num_blocks, const int64_t *kept, int64_t num_kept) {
    /* (not `I`: <complex.h>, which SIMDe's emulated AVX-512 headers pull in, defines it) */
    const int64_t H = shape.hidden, D = shape.head_dim, inter = shape.intermediate;
    const int64_t q_size = shape.num_heads * D, kv_size = shape.num_kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size;
    if (D > 512 || D % 2 != 0) return -3;
    if (kept != NULL && (num_kept < 0 || num_kept > rows)) return -4;
    const int64_t cache_half = num_blocks * block_size * kv_size;  // K, then V
    forward_step step = {shape, block_table, max_blocks, block_size, num_blocks, NULL, NULL, NULL, NULL, NULL};
    step.normed = malloc(sizeof(float) * (size_t)(rows * H));
    float *qkv = malloc(sizeof(float) * (size_t)(rows * qkv_size));
    float *queries = malloc(sizeof(float) * (size_t)(rows * q_size));
    step.attended = malloc(sizeof(float) * (size_t)(rows * q_size));
    step.gate_up = malloc(sizeof(float) * (size_t)(rows * 2 * inter));
    step.activated = malloc(sizeof(float) * (size_t)(rows * inter));
    step.update = malloc(sizeof(float) * (size_t)(rows * H));
    int status = 0;
    if (!step.normed || !qkv || !queries || !step.attended || !step.gate_up || !step.activated || !step.update)
        status = -2;
    const int prune_last = kept != NULL && num_kept < rows && num_layers > 0;
    for (int64_t l = 0; l < num_layers && status == 0; l++) {
        const heron_decoder_layer *layer = layers + l;
        rms_norm(hidden, layer->input_norm, step.normed, rows, H, shape.eps);
        if ((status = linear(&layer->qkv, step.normed, rows, H, qkv, qkv_size)) != 0) break;
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
        for (int64_t r = 0; r < rows; r++) {
            float *row = qkv + r * qkv_size;
            for (int64_t h = 0; h < shape.num_heads + shape.num_kv_heads; h++)
                rope(row + h * D, cos + r * D, signed_sin + r * D, D);
            memcpy(queries + r * q_size, row, sizeof(float) * (size_t)q_size);
            if (shape.kv_half) {
                uint16_t *key_slot = (uint16_t *)layer->kv_cache + slots[r] * kv_size;
                heron_store_halves(key_slot, row + q_size, kv_size);
                heron_store_halves(key_slot + cache_half, row + q_size + kv_size, kv_size);
            } else {
                float *key_slot = (float *)layer->kv_cache + slots[r] * kv_size;
                memcpy(key_slot, row + q_size, sizeof(float) * (size_t)kv_size);
                memcpy(key_slot + cache_half, row + q_size + kv_size, sizeof(float) * (size_t)kv_size);
            }
        }
        if (prune_last && l == num_layers - 1)
            status = finish_kept_rows(&step, layer, final_norm, hidden, queries, table_rows, seq_lens, kept, num_kept);
        else
            status = finish_layer(&step, layer, hidden, rows, queries, table_rows, seq_lens);
    }
    if (status == 0 && !prune_last) {
        rms_norm(hidden, final_norm, step.normed, rows, H, shape.eps);
        memcpy(hidden, step.normed, sizeof(float) * (size_t)(rows * H));
    }
    free(step.normed), free(qkv), free(queries), free(step.attended), free(step.gate_up), free(step.activated);
    free(step.update);
    return status;
}
