/*
 * The int4 mode's linear layers on the CPU, for any number of rows, as
 * register-tiled kernels: heron_q4_linear_f32 for the 4-bit layers and
 * heron_q8_linear_f32 for int8 weights (the int8 mode's layers and both modes'
 * LM head; at the end of this file).
 *
 * 4-bit layers: weights in GGUF's Q4_1 scheme (blocks of 32 inputs, w = d * q + m with q in
 * 0..15) times the input rounded to int8 in blocks of 16 (lowbit_input.h),
 * with integer dot products in a register-tiled kernel.
 *
 *   y[r, c] = sum_B d[c, B] (e0 P0 + e1 P1) + m[c, B] s[r, B]
 *
 * with P0, P1 the integer sums q * p over the block's two halves, e0, e1 their
 * input scales and s[r, B] the rounded input block's sum, so the layer computes
 * exactly W x^ for the rounded input x^ (the weights' minimum does not amplify
 * the rounding error).
 *
 * Layout ("column tiles", built at load by quantization.py): 8 consecutive
 * output columns form a tile; per tile and block of 32 inputs, 128 bytes: for
 * each half h (16 inputs: groups g = 0..3 of 4 inputs) two 32-byte vectors
 * j = 0, 1 at offset 64 h + 32 j, whose byte 4 c + i holds column c's input
 * 16 h + 4 j + i in its low nibble and input 16 h + 4 (j + 2) + i in its high
 * nibble. Unpacked (and, shift), a vector holds one group for all 8 columns, and
 * one maddubs with the group's 4 input bytes broadcast to every lane (then madd)
 * gives one int32 partial sum per column: no horizontal sums, and each unpacked
 * weight vector serves TILE_ROWS rows. Scales d and minimums m are
 * [n / 8, k / 32, 8] floats, a tile's 8 columns side by side.
 *
 * The int16 sums of a half's 4 maddubs are added before one madd: each is at most
 * 2 * 15 * 127, four fit in int16. Every row runs the same instructions whatever
 * the batch holds, so a row's result does not depend on its batch.
 *
 * Why: a dot-product kernel (one output at a time, horizontal sums) ran 2-4x
 * slower than this at 2-16 rows, and the float32 GEMM on dequantized weights,
 * at this CPU's float32 peak, is about 1.5x slower on prompts. Weights keep an
 * eighth of float32's bytes, which bounds a batch-1 step.
 *
 * Work (both kernels): rows in panels of PANEL_ROWS, within a panel each column
 * tile over the panel's rows TILE_ROWS at a time (the tile's weights stay in
 * L1); tiles x panels are split over OpenMP threads.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "lowbit_input.h"

#define TILE_COLS 8
#define TILE_ROWS 4
#define PANEL_ROWS 64
#define TILE_BLOCK_BYTES 128 /* one tile's 32 inputs x 8 columns, two nibbles a byte */

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256i broadcast4(const int8_t *p) {
    int32_t bytes;
    memcpy(&bytes, p, 4);
    return _mm256_set1_epi32(bytes);
}

/* rows r0..r0+rm-1 times one column tile; rm <= TILE_ROWS, a constant after inlining */
static inline __attribute__((always_inline)) void q4_tile_rows(int rm, const uint8_t *tile, const float *d, const float *m,
                                                            const quantized_input *in, int64_t r0, int64_t k, float *y,
                                                            int64_t n_out) {
    const int64_t nb = k / 32;
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[TILE_ROWS];
    for (int r = 0; r < rm; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256 db = _mm256_loadu_ps(d + b * TILE_COLS), mb = _mm256_loadu_ps(m + b * TILE_COLS);
        for (int half = 0; half < 2; half++) {
            const uint8_t *w = tile + b * TILE_BLOCK_BYTES + half * 64;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)w);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            const __m256i w0 = _mm256_and_si256(v0, nibble), w1 = _mm256_and_si256(v1, nibble);
            const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
            const __m256i w3 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
            for (int r = 0; r < rm; r++) {
                const int8_t *p = in->p + (r0 + r) * k + b * 32 + half * 16;
                __m256i sum = _mm256_maddubs_epi16(w0, broadcast4(p));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w1, broadcast4(p + 4)));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w2, broadcast4(p + 8)));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w3, broadcast4(p + 12)));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
                const __m256 scale = _mm256_mul_ps(db, _mm256_broadcast_ss(in->e + ((r0 + r) * nb + b) * 8 + half * 4));
                acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
            }
        }
        for (int r = 0; r < rm; r++) acc[r] = _mm256_fmadd_ps(mb, _mm256_broadcast_ss(in->s + (r0 + r) * nb + b), acc[r]);
    }
    for (int r = 0; r < rm; r++) _mm256_storeu_ps(y + (r0 + r) * n_out, acc[r]);
}

static void q4_panel(const uint8_t *tile, const float *d, const float *m, const quantized_input *in, int64_t r,
                     int64_t end, int64_t k, float *y, int64_t n_out) {
    for (; r + TILE_ROWS <= end; r += TILE_ROWS) q4_tile_rows(TILE_ROWS, tile, d, m, in, r, k, y, n_out);
    switch (end - r) { /* TILE_ROWS == 4 */
        case 3: q4_tile_rows(3, tile, d, m, in, r, k, y, n_out); break;
        case 2: q4_tile_rows(2, tile, d, m, in, r, k, y, n_out); break;
        case 1: q4_tile_rows(1, tile, d, m, in, r, k, y, n_out); break;
        default: break;
    }
}
#else
/* the weight value of column c, input i (of the block) in a tile block's 128 bytes */
static inline int tile_value(const uint8_t *block, int c, int i) {
    const int half = i / 16, group = (i % 16) / 4, j = group % 2;
    const uint8_t byte = block[half * 64 + j * 32 + c * 4 + i % 4];
    return group < 2 ? byte & 0x0F : byte >> 4;
}

static void q4_panel(const uint8_t *tile, const float *d, const float *m, const quantized_input *in, int64_t r,
                     int64_t end, int64_t k, float *y, int64_t n_out) {
    const int64_t nb = k / 32;
    for (; r < end; r++) {
        const int8_t *p = in->p + r * k;
        for (int c = 0; c < TILE_COLS; c++) {
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float block = 0.0f;
                for (int half = 0; half < 2; half++) {
                    int32_t dot = 0;
                    for (int i = half * 16; i < half * 16 + 16; i++)
                        dot += tile_value(tile + b * TILE_BLOCK_BYTES, c, i) * p[b * 32 + i];
                    block += (float)dot * in->e[(r * nb + b) * 8 + half * 4];
                }
                total += d[b * TILE_COLS + c] * block + m[b * TILE_COLS + c] * in->s[r * nb + b];
            }
            y[r * n_out + c] = total;
        }
    }
}
#endif

/* Runs panel(weights, tile t, rows [start, end)) for every column tile and row
 * panel of an [rows, n] output, split over threads; the weights' pointers are
 * the panel function's business. 0, or -2 when out of memory. */
typedef void (*panel_function)(const void *weights, int64_t tile, const quantized_input *in, int64_t start,
                               int64_t end, int64_t k, float *y, int64_t n_out);

static int run_tiles(panel_function panel, const void *weights, const float *x, int64_t rows, int64_t k, float *y,
                     int64_t n_out) {
    quantized_input in;
    if (heron_quantize_input(x, rows, k, &in) != 0) return -2;
    const int64_t num_tiles = n_out / TILE_COLS, num_panels = (rows + PANEL_ROWS - 1) / PANEL_ROWS;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t start = p * PANEL_ROWS, end = start + PANEL_ROWS < rows ? start + PANEL_ROWS : rows;
            panel(weights, t, &in, start, end, k, y + t * TILE_COLS, n_out);
        }
    }
    heron_release_input(&in);
    return 0;
}

typedef struct {
    const uint8_t *tiles;
    const float *scales, *mins;
} q4_weights;

static void q4_tile_panel(const void *weights, int64_t t, const quantized_input *in, int64_t start, int64_t end,
                          int64_t k, float *y, int64_t n_out) {
    const q4_weights *w = weights;
    const int64_t nb = k / 32;
    q4_panel(w->tiles + t * nb * TILE_BLOCK_BYTES, w->scales + t * nb * TILE_COLS, w->mins + t * nb * TILE_COLS, in,
             start, end, k, y, n_out);
}

/* y [rows, n] = Q8(x) @ (d * q + m)^T for weights in column tiles (see above);
 * k a multiple of 32, n of 8. 0, -1 on bad shapes, -2 when out of memory. */
int heron_q4_linear_f32(const float *x, int64_t rows, int64_t k, const uint8_t *tiles, const float *scales,
                        const float *mins, float *y, int64_t n_out) {
    if (k % 32 != 0 || n_out % TILE_COLS != 0) return -1;
    const q4_weights weights = {tiles, scales, mins};
    return run_tiles(q4_tile_panel, &weights, x, rows, k, y, n_out);
}

/*
 * int8 weights (the int8 mode's layers, both modes' LM head): w (|w| <= 127) with one float scale per output
 * column, times the same int8 inputs:  y[r, c] = scale[c] sum_b e_b P_b(r, c).
 * Layout: tiles of 8 columns, each 4 inputs a 32-byte vector (byte 4 c + i:
 * column c, input 4 g + i), [n / 8, k / 4, 32] int8. maddubs needs an unsigned
 * operand, so |w| times p with w's sign; its int16 pairs reach 2 * 127 * 127,
 * so each goes to int32 (madd) before the next is added.
 */
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void q8_tile_rows(int rm, const int8_t *tile, const float *column_scales,
                                                               const quantized_input *in, int64_t r0, int64_t k,
                                                               float *y, int64_t n_out) {
    const int64_t nb = k / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE_ROWS];
    for (int r = 0; r < rm; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t h = 0; h < k / 16; h++) { /* input blocks of 16: one scale each */
        __m256i part[TILE_ROWS];
        for (int r = 0; r < rm; r++) part[r] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(tile + (h * 4 + g) * 32));
            const __m256i magnitude = _mm256_sign_epi8(w, w);
            for (int r = 0; r < rm; r++) {
                const __m256i p = _mm256_sign_epi8(broadcast4(in->p + (r0 + r) * k + h * 16 + g * 4), w);
                part[r] = _mm256_add_epi32(part[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, p), ones));
            }
        }
        for (int r = 0; r < rm; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[r]),
                                     _mm256_broadcast_ss(in->e + ((r0 + r) * nb + h / 2) * 8 + (h % 2) * 4), acc[r]);
    }
    const __m256 scales = _mm256_loadu_ps(column_scales);
    for (int r = 0; r < rm; r++) _mm256_storeu_ps(y + (r0 + r) * n_out, _mm256_mul_ps(acc[r], scales));
}

static void q8_panel(const int8_t *tile, const float *column_scales, const quantized_input *in, int64_t r,
                     int64_t end, int64_t k, float *y, int64_t n_out) {
    for (; r + TILE_ROWS <= end; r += TILE_ROWS) q8_tile_rows(TILE_ROWS, tile, column_scales, in, r, k, y, n_out);
    switch (end - r) { /* TILE_ROWS == 4 */
        case 3: q8_tile_rows(3, tile, column_scales, in, r, k, y, n_out); break;
        case 2: q8_tile_rows(2, tile, column_scales, in, r, k, y, n_out); break;
        case 1: q8_tile_rows(1, tile, column_scales, in, r, k, y, n_out); break;
        default: break;
    }
}
#else
static void q8_panel(const int8_t *tile, const float *column_scales, const quantized_input *in, int64_t r,
                     int64_t end, int64_t k, float *y, int64_t n_out) {
    const int64_t nb = k / 32;
    for (; r < end; r++) {
        for (int c = 0; c < TILE_COLS; c++) {
            float total = 0.0f;
            for (int64_t h = 0; h < k / 16; h++) {
                int32_t dot = 0;
                for (int i = 0; i < 16; i++) dot += tile[(h * 4 + i / 4) * 32 + c * 4 + i % 4] * in->p[r * k + h * 16 + i];
                total += (float)dot * in->e[(r * nb + h / 2) * 8 + (h % 2) * 4];
            }
            y[r * n_out + c] = total * column_scales[c];
        }
    }
}
#endif

typedef struct {
    const int8_t *tiles;
    const float *scales;
} q8_weights;

static void q8_tile_panel(const void *weights, int64_t t, const quantized_input *in, int64_t start, int64_t end,
                          int64_t k, float *y, int64_t n_out) {
    const q8_weights *w = weights;
    q8_panel(w->tiles + t * k * TILE_COLS, w->scales + t * TILE_COLS, in, start, end, k, y, n_out);
}

/* y [rows, n] = Q8(x) @ (w * scale)^T for int8 weights in column tiles (see above)
 * and scale [n] float; k a multiple of 32, n of 8. 0, -1 on bad shapes, -2 when out of memory. */
int heron_q8_linear_f32(const float *x, int64_t rows, int64_t k, const int8_t *tiles, const float *column_scales,
                        float *y, int64_t n_out) {
    if (k % 32 != 0 || n_out % TILE_COLS != 0) return -1;
    const q8_weights weights = {tiles, column_scales};
    return run_tiles(q8_tile_panel, &weights, x, rows, k, y, n_out);
}
