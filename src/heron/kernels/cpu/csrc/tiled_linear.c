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
 * (computed in that grouping: the two halves' integer sums scaled by their input
 * scales first, then one multiply-add by d: a float multiply per block fewer than
 * scaling each half by d e separately)
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
 * Instruction sets (simd.h): the AVX2 build runs one tile per 256-bit vector;
 * the AVX-512 builds two adjacent tiles per 512-bit vector (16 columns, so
 * one broadcast input serves both) above SINGLE_TILE_MAX_ROWS rows, and one
 * tile per 256-bit vector below, with vpdpbusd where VNNI is present in
 * place of maddubs + madd. The portable build is the reference. All of them
 * compute each output with the same exact integer sums and the same float
 * operations in the same order, so every build's results are bit-identical.
 *
 * Work (both kernels): rows in panels of PANEL_ROWS, within a panel each column
 * tile (or pair of tiles) over the panel's rows TILE_ROWS at a time (the
 * weights stay in L1); tiles x panels are split over OpenMP threads. The
 * inputs of TILE_ROWS rows lie interleaved (lowbit_input.h), so a kernel
 * reaches them from one pointer at constant offsets: with a pointer per row
 * the AVX2 int4 kernel spilt them to the stack and re-added them every block,
 * about 190 instructions a block of 4 rows x 8 columns x 32 inputs where it
 * now takes 165 (30 int4 layers at 283 rows on a Zen 3: 18% faster by median, 8% by best time).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lowbit_input.h"
#include "simd.h"

#define TILE_COLS 8
#define TILE_ROWS 4
#define PANEL_ROWS 64
#define TILE_BLOCK_BYTES 128 /* one tile's 32 inputs x 8 columns, two nibbles a byte */
/* a kernel's rows are one group of the interleaved input (lowbit_input.h), and every panel starts a group */
_Static_assert(TILE_ROWS == INPUT_GROUP_ROWS && PANEL_ROWS % TILE_ROWS == 0, "rows in whole input groups");

#if defined(HERON_AVX512)
#define TILES_PER_TASK 2 /* a 512-bit vector holds two column tiles */
#else
#define TILES_PER_TASK 1
#endif
/* AVX-512 builds: up to this many rows, one tile per 256-bit vector (vpdpbusd on ymm with VNNI) instead of a pair
 * per 512-bit one. Measured on a Zen 4 EPYC (which runs 512-bit operations as two 256-bit halves), 30 layers: 1 row
 * 4.0 -> 3.3 ms, 4 rows 6.4 -> 5.7 ms, even at 5-6 rows, pairs ahead from 7; the int8 LM head at 1 row 1.07 -> 0.75 ms */
#define SINGLE_TILE_MAX_ROWS 5

/* ROW_GROUPS(CALL): CALL(rm, r) for rows [r, end) TILE_ROWS (4) at a time, then
 * the remainder, so rm is a constant in every inlined call */
#define ROW_GROUPS(CALL)                                          \
    do {                                                          \
        for (; r + TILE_ROWS <= end; r += TILE_ROWS) CALL(TILE_ROWS, r); \
        switch (end - r) {                                        \
            case 3: CALL(3, r); break;                            \
            case 2: CALL(2, r); break;                            \
            case 1: CALL(1, r); break;                            \
            default: break;                                       \
        }                                                         \
    } while (0)

#if defined(HERON_AVX2)
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
    /* the row group's inputs, one block after another (lowbit_input.h; r0 is a multiple of TILE_ROWS) */
    const int8_t *pq = group_inputs(in, r0, nb);
    const float *eq = group_scales(in, r0, nb), *sq = group_sums(in, r0, nb);
    __m256 acc[TILE_ROWS], scaled[TILE_ROWS];
    for (int r = 0; r < rm; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, pq += INPUT_BLOCK_BYTES, eq += INPUT_BLOCK_SCALES, sq += INPUT_GROUP_ROWS) {
        for (int half = 0; half < 2; half++) {
            const uint8_t *w = tile + b * TILE_BLOCK_BYTES + half * 64;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)w);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            const __m256i w0 = _mm256_and_si256(v0, nibble), w1 = _mm256_and_si256(v1, nibble);
            const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
            const __m256i w3 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
            for (int r = 0; r < rm; r++) {
                const int8_t *p = pq + half * 64 + r * 4; /* its groups of 4 inputs 16 bytes apart */
#if defined(HERON_AVX512_VNNI)
                const __m256i even = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w0, broadcast4(p));
                const __m256i odd = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w1, broadcast4(p + 16));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_dpbusd_epi32(even, w2, broadcast4(p + 32)),
                                                                       _mm256_dpbusd_epi32(odd, w3, broadcast4(p + 48))));
#else
                __m256i sum = _mm256_maddubs_epi16(w0, broadcast4(p));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w1, broadcast4(p + 16)));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w2, broadcast4(p + 32)));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w3, broadcast4(p + 48)));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
#endif
                const __m256 e = _mm256_broadcast_ss(eq + half * 4 + r);
                scaled[r] = half == 0 ? _mm256_mul_ps(dot, e) : _mm256_fmadd_ps(dot, e, scaled[r]);
            }
        }
        const __m256 db = _mm256_loadu_ps(d + b * TILE_COLS), mb = _mm256_loadu_ps(m + b * TILE_COLS);
        for (int r = 0; r < rm; r++)
            acc[r] = _mm256_fmadd_ps(mb, _mm256_broadcast_ss(sq + r), _mm256_fmadd_ps(db, scaled[r], acc[r]));
    }
    for (int r = 0; r < rm; r++) _mm256_storeu_ps(y + (r0 + r) * n_out, acc[r]);
}
#define Q4_TILE(rm, r) q4_tile_rows(rm, tile, d, m, in, r, k, y, n_out)
#else
/* the weight value of column c, input i (of the block) in a tile block's 128 bytes */
static inline int tile_value(const uint8_t *block, int c, int i) {
    const int half = i / 16, group = (i % 16) / 4, j = group % 2;
    const uint8_t byte = block[half * 64 + j * 32 + c * 4 + i % 4];
    return group < 2 ? byte & 0x0F : byte >> 4;
}

/* the reference: each output's float operations in the vector kernels' order */
static void q4_tile_rows_portable(const uint8_t *tile, const float *d, const float *m, const quantized_input *in,
                                  int64_t r, int64_t k, float *y, int64_t n_out) {
    const int64_t nb = k / 32;
    for (int c = 0; c < TILE_COLS; c++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            float scaled = 0.0f; /* e0 P0 + e1 P1 */
            for (int half = 0; half < 2; half++) {
                int32_t dot = 0;
                for (int i = half * 16; i < half * 16 + 16; i++)
                    dot += tile_value(tile + b * TILE_BLOCK_BYTES, c, i) * input_value(in, r, nb, b * 32 + i);
                const float e = input_scale(in, r, nb, b, half);
                scaled = half == 0 ? (float)dot * e : fmaf((float)dot, e, scaled);
            }
            total = fmaf(m[b * TILE_COLS + c], input_sum(in, r, nb, b), fmaf(d[b * TILE_COLS + c], scaled, total));
        }
        y[r * n_out + c] = total;
    }
}
#define Q4_TILE(rm, r) for (int64_t row = r; row < r + rm; row++) q4_tile_rows_portable(tile, d, m, in, row, k, y, n_out)
#endif

#if defined(HERON_AVX512)
static inline __m512i broadcast4_512(const int8_t *p) {
    int32_t bytes;
    memcpy(&bytes, p, 4);
    return _mm512_set1_epi32(bytes);
}

/* tile t's 32 bytes in the low half, tile t + 1's in the high half */
static inline __m512i load_tile_pair(const void *low, const void *high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)low)),
                              _mm256_loadu_si256((const __m256i *)high), 1);
}

static inline __m512 load_float_pair(const float *low, const float *high) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(low)), _mm256_loadu_ps(high), 1);
}

/* per column, the int32 sum over 16 inputs of a half block's four groups of weights w0..w3: the groups' 4 input
 * bytes at p, p + 16, p + 32, p + 48 (lowbit_input.h) */
static inline __m512i q4_half_dot(__m512i w0, __m512i w1, __m512i w2, __m512i w3, const int8_t *p) {
#if defined(HERON_AVX512_VNNI)
    /* two chains of two, so four dependent vpdpbusd do not serialise (exact integer sums: any order) */
    const __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, broadcast4_512(p));
    const __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, broadcast4_512(p + 16));
    return _mm512_add_epi32(_mm512_dpbusd_epi32(even, w2, broadcast4_512(p + 32)),
                            _mm512_dpbusd_epi32(odd, w3, broadcast4_512(p + 48)));
#else
    __m512i sum = _mm512_maddubs_epi16(w0, broadcast4_512(p));
    sum = _mm512_add_epi16(sum, _mm512_maddubs_epi16(w1, broadcast4_512(p + 16)));
    sum = _mm512_add_epi16(sum, _mm512_maddubs_epi16(w2, broadcast4_512(p + 32)));
    sum = _mm512_add_epi16(sum, _mm512_maddubs_epi16(w3, broadcast4_512(p + 48)));
    return _mm512_madd_epi16(sum, _mm512_set1_epi16(1));
#endif
}

/* rows r0..r0+rm-1 times column tiles t and t + 1 (16 adjacent columns) */
static inline __attribute__((always_inline)) void q4_pair_rows(int rm, const uint8_t *tile, const float *d, const float *m,
                                                            const quantized_input *in, int64_t r0, int64_t k, float *y,
                                                            int64_t n_out) {
    const int64_t nb = k / 32;
    const uint8_t *tile2 = tile + nb * TILE_BLOCK_BYTES;
    const float *d2 = d + nb * TILE_COLS, *m2 = m + nb * TILE_COLS;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int8_t *pq = group_inputs(in, r0, nb); /* as in q4_tile_rows */
    const float *eq = group_scales(in, r0, nb), *sq = group_sums(in, r0, nb);
    __m512 acc[TILE_ROWS], scaled[TILE_ROWS];
    for (int r = 0; r < rm; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, pq += INPUT_BLOCK_BYTES, eq += INPUT_BLOCK_SCALES, sq += INPUT_GROUP_ROWS) {
        for (int half = 0; half < 2; half++) {
            const int64_t offset = b * TILE_BLOCK_BYTES + half * 64;
            const __m512i v0 = load_tile_pair(tile + offset, tile2 + offset);
            const __m512i v1 = load_tile_pair(tile + offset + 32, tile2 + offset + 32);
            const __m512i w0 = _mm512_and_si512(v0, nibble), w1 = _mm512_and_si512(v1, nibble);
            const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble);
            const __m512i w3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble);
            for (int r = 0; r < rm; r++) {
                const __m512 dot = _mm512_cvtepi32_ps(q4_half_dot(w0, w1, w2, w3, pq + half * 64 + r * 4));
                const __m512 e = _mm512_set1_ps(eq[half * 4 + r]);
                scaled[r] = half == 0 ? _mm512_mul_ps(dot, e) : _mm512_fmadd_ps(dot, e, scaled[r]);
            }
        }
        const __m512 db = load_float_pair(d + b * TILE_COLS, d2 + b * TILE_COLS);
        const __m512 mb = load_float_pair(m + b * TILE_COLS, m2 + b * TILE_COLS);
        for (int r = 0; r < rm; r++)
            acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(sq[r]), _mm512_fmadd_ps(db, scaled[r], acc[r]));
    }
    for (int r = 0; r < rm; r++) _mm512_storeu_ps(y + (r0 + r) * n_out, acc[r]);
}
#define Q4_PAIR(rm, r) q4_pair_rows(rm, tile, d, m, in, r, k, y, n_out)
#endif

/* rows [r, end) times `tiles` (1, or 2 in AVX-512 builds) adjacent column tiles */
static void q4_panel(const uint8_t *tile, const float *d, const float *m, int64_t tiles, const quantized_input *in,
                     int64_t r, int64_t end, int64_t k, float *y, int64_t n_out) {
#if defined(HERON_AVX512)
    if (tiles == 2) {
        ROW_GROUPS(Q4_PAIR);
        return;
    }
#endif
    (void)tiles;
    ROW_GROUPS(Q4_TILE);
}

/* Runs panel(weights, tiles [t, t + count), rows [start, end)) for every group of
 * TILES_PER_TASK column tiles (one up to SINGLE_TILE_MAX_ROWS rows) and row panel of an [rows, n] output, split over
 * threads; the weights' pointers are the panel function's business. 0, or -2
 * when out of memory. */
typedef void (*panel_function)(const void *weights, int64_t tile, int64_t count, const quantized_input *in,
                               int64_t start, int64_t end, int64_t k, float *y, int64_t n_out);

static int run_tiles(panel_function panel, const void *weights, const float *x, int64_t rows, int64_t k, float *y,
                     int64_t n_out) {
    quantized_input in;
    if (heron_quantize_input(x, rows, k, &in) != 0) return -2;
    const int64_t num_tiles = n_out / TILE_COLS, num_panels = (rows + PANEL_ROWS - 1) / PANEL_ROWS;
    const int64_t per_task = rows <= SINGLE_TILE_MAX_ROWS ? 1 : TILES_PER_TASK;
    const int64_t num_groups = (num_tiles + per_task - 1) / per_task;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t g = 0; g < num_groups; g++) {
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t t = g * per_task, count = num_tiles - t < per_task ? num_tiles - t : per_task;
            const int64_t start = p * PANEL_ROWS, end = start + PANEL_ROWS < rows ? start + PANEL_ROWS : rows;
            panel(weights, t, count, &in, start, end, k, y + t * TILE_COLS, n_out);
        }
    }
    heron_release_input(&in);
    return 0;
}

typedef struct {
    const uint8_t *tiles;
    const float *scales, *mins;
} q4_weights;

static void q4_tile_panel(const void *weights, int64_t t, int64_t count, const quantized_input *in, int64_t start,
                          int64_t end, int64_t k, float *y, int64_t n_out) {
    const q4_weights *w = weights;
    const int64_t nb = k / 32;
    q4_panel(w->tiles + t * nb * TILE_BLOCK_BYTES, w->scales + t * nb * TILE_COLS, w->mins + t * nb * TILE_COLS, count,
             in, start, end, k, y, n_out);
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
 * column c, input 4 g + i), [n / 8, k / 4, 32] int8. maddubs (and vpdpbusd)
 * need an unsigned operand, so |w| times p with w's sign; maddubs' int16 pairs
 * reach 2 * 127 * 127, so each goes to int32 (madd) before the next is added.
 */
#if defined(HERON_AVX2)
static inline __attribute__((always_inline)) void q8_tile_rows(int rm, const int8_t *tile, const float *column_scales,
                                                               const quantized_input *in, int64_t r0, int64_t k,
                                                               float *y, int64_t n_out) {
    const __m256i ones = _mm256_set1_epi16(1);
    /* the row group's inputs (lowbit_input.h): a half block of 16 is 64 bytes, its scales 4 floats */
    const int8_t *pq = group_inputs(in, r0, k / 32);
    const float *eq = group_scales(in, r0, k / 32);
    __m256 acc[TILE_ROWS];
    for (int r = 0; r < rm; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t h = 0; h < k / 16; h++, pq += INPUT_BLOCK_BYTES / 2, eq += INPUT_GROUP_ROWS) { /* input blocks of 16: one scale each */
        __m256i part[TILE_ROWS];
        for (int r = 0; r < rm; r++) part[r] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(tile + (h * 4 + g) * 32));
            const __m256i magnitude = _mm256_sign_epi8(w, w);
            for (int r = 0; r < rm; r++) {
                const __m256i p = _mm256_sign_epi8(broadcast4(pq + g * 16 + r * 4), w);
                part[r] = _mm256_add_epi32(part[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, p), ones));
            }
        }
        for (int r = 0; r < rm; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[r]), _mm256_broadcast_ss(eq + r), acc[r]);
    }
    const __m256 scales = _mm256_loadu_ps(column_scales);
    for (int r = 0; r < rm; r++) _mm256_storeu_ps(y + (r0 + r) * n_out, _mm256_mul_ps(acc[r], scales));
}
#define Q8_TILE(rm, r) q8_tile_rows(rm, tile, column_scales, in, r, k, y, n_out)
#else
static void q8_tile_rows_portable(const int8_t *tile, const float *column_scales, const quantized_input *in, int64_t r,
                                  int64_t k, float *y, int64_t n_out) {
    const int64_t nb = k / 32;
    for (int c = 0; c < TILE_COLS; c++) {
        float total = 0.0f;
        for (int64_t h = 0; h < k / 16; h++) {
            int32_t dot = 0;
            for (int i = 0; i < 16; i++)
                dot += tile[(h * 4 + i / 4) * 32 + c * 4 + i % 4] * input_value(in, r, nb, h * 16 + i);
            total = fmaf((float)dot, input_scale(in, r, nb, h / 2, (int)(h % 2)), total);
        }
        y[r * n_out + c] = total * column_scales[c];
    }
}
#define Q8_TILE(rm, r) for (int64_t row = r; row < r + rm; row++) q8_tile_rows_portable(tile, column_scales, in, row, k, y, n_out)
#endif

#if defined(HERON_AVX512)
/* rows r0..r0+rm-1 times column tiles t and t + 1 */
static inline __attribute__((always_inline)) void q8_pair_rows(int rm, const int8_t *tile, const float *column_scales,
                                                               const quantized_input *in, int64_t r0, int64_t k,
                                                               float *y, int64_t n_out) {
    const int8_t *tile2 = tile + k * TILE_COLS;
    const int8_t *pq = group_inputs(in, r0, k / 32); /* as in q8_tile_rows */
    const float *eq = group_scales(in, r0, k / 32);
    const __m512i zero = _mm512_setzero_si512();
#if !defined(HERON_AVX512_VNNI)
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    __m512 acc[TILE_ROWS];
    for (int r = 0; r < rm; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t h = 0; h < k / 16; h++, pq += INPUT_BLOCK_BYTES / 2, eq += INPUT_GROUP_ROWS) {
        __m512i part[TILE_ROWS];
        for (int r = 0; r < rm; r++) part[r] = zero;
        for (int g = 0; g < 4; g++) {
            const int64_t offset = (h * 4 + g) * 32;
            const __m512i w = load_tile_pair(tile + offset, tile2 + offset);
            const __m512i magnitude = _mm512_abs_epi8(w);
            const __mmask64 negative = _mm512_movepi8_mask(w);
            for (int r = 0; r < rm; r++) {
                const __m512i x = broadcast4_512(pq + g * 16 + r * 4);
                const __m512i p = _mm512_mask_sub_epi8(x, negative, zero, x); /* x with w's sign */
#if defined(HERON_AVX512_VNNI)
                part[r] = _mm512_dpbusd_epi32(part[r], magnitude, p);
#else
                part[r] = _mm512_add_epi32(part[r], _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, p), ones));
#endif
            }
        }
        for (int r = 0; r < rm; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r]), _mm512_set1_ps(eq[r]), acc[r]);
    }
    const __m512 scales = _mm512_loadu_ps(column_scales);
    for (int r = 0; r < rm; r++) _mm512_storeu_ps(y + (r0 + r) * n_out, _mm512_mul_ps(acc[r], scales));
}
#define Q8_PAIR(rm, r) q8_pair_rows(rm, tile, column_scales, in, r, k, y, n_out)
#endif

static void q8_panel(const int8_t *tile, const float *column_scales, int64_t tiles, const quantized_input *in,
                     int64_t r, int64_t end, int64_t k, float *y, int64_t n_out) {
#if defined(HERON_AVX512)
    if (tiles == 2) {
        ROW_GROUPS(Q8_PAIR);
        return;
    }
#endif
    (void)tiles;
    ROW_GROUPS(Q8_TILE);
}

typedef struct {
    const int8_t *tiles;
    const float *scales;
} q8_weights;

static void q8_tile_panel(const void *weights, int64_t t, int64_t count, const quantized_input *in, int64_t start,
                          int64_t end, int64_t k, float *y, int64_t n_out) {
    const q8_weights *w = weights;
    q8_panel(w->tiles + t * k * TILE_COLS, w->scales + t * TILE_COLS, count, in, start, end, k, y, n_out);
}

/* y [rows, n] = Q8(x) @ (w * scale)^T for int8 weights in column tiles (see above)
 * and scale [n] float; k a multiple of 32, n of 8. 0, -1 on bad shapes, -2 when out of memory. */
int heron_q8_linear_f32(const float *x, int64_t rows, int64_t k, const int8_t *tiles, const float *column_scales,
                        float *y, int64_t n_out) {
    if (k % 32 != 0 || n_out % TILE_COLS != 0) return -1;
    const q8_weights weights = {tiles, column_scales};
    return run_tiles(q8_tile_panel, &weights, x, rows, k, y, n_out);
}

/* the instruction set this library was built for (simd.h) */
const char *heron_kernel_isa(void) { return HERON_ISA_NAME; }
