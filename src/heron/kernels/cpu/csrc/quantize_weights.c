/*
 * Load-time packing of float weights into the low-bit layers' column tiles
 * (tiled_linear.c's layouts), in one pass: about 10x faster than the torch ops
 * of quantization.py, which compute the same values (they stay the reference
 * and the fallback without a C compiler; the tests check both agree bit for bit).
 *
 * int4 (heron_pack_q4_tiles):
 * Per output row and block of 32 inputs: the better of GGUF's Q4_1 grid (m = min,
 * d = (max - m) / 15, 1 where that is not positive) and Q4_0's (fit_block), q =
 * round-half-even clamped to 0..15. Rows past n (up to the tiles' multiple of 8)
 * are padding: q = 0, d = 1, m = 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE_COLS 8
#define TILE_BLOCK_BYTES 128

/* q = clamp(round-half-even((x - shift) / d + offset), 0, 15); returns the largest
 * error of q * d + m (a maximum: exact in any order, so the torch formula makes
 * the same choice). shift 0 and offset 0 change no value: one formula serves both grids. */
static float fit_grid(const float *x, float shift, float d, float offset, float m, uint8_t *q) {
    float error = 0.0f;
    for (int i = 0; i < 32; i++) {
        const float v = nearbyintf((x[i] - shift) / d + offset);
        q[i] = (uint8_t)(v < 0.0f ? 0.0f : v > 15.0f ? 15.0f : v);
        const float back = fabsf((float)q[i] * d + m - x[i]);
        error = back > error ? back : error;
    }
    return error;
}

/* One block of 32 weights on the better of two 16-level grids d * q + m, each the
 * rule a GGUF type quantizes with, so either type's blocks come back exactly:
 * the range (Q4_1: m = min, d = (max - min) / 15) and the symmetric grid (Q4_0:
 * d = -x / 8 for x the first weight of largest magnitude, m = -8 d). */
static void fit_block(const float *x, uint8_t *q, float *d, float *m) {
    float low = x[0], high = x[0], extreme = x[0];
    for (int i = 1; i < 32; i++) { /* comparisons, not fminf: they vectorize */
        low = x[i] < low ? x[i] : low;
        high = x[i] > high ? x[i] : high;
        extreme = fabsf(x[i]) > fabsf(extreme) ? x[i] : extreme;
    }
    float range_d = (high - low) / 15.0f;
    if (!(range_d > 0.0f)) range_d = 1.0f;
    const float error = fit_grid(x, low, range_d, 0.0f, low, q);
    *d = range_d, *m = low;
    const float symmetric_d = extreme / -8.0f;
    if (error > 0.0f && symmetric_d != 0.0f) {
        uint8_t symmetric[32];
        if (fit_grid(x, 0.0f, symmetric_d, 8.0f, -8.0f * symmetric_d, symmetric) < error) {
            memcpy(q, symmetric, 32);
            *d = symmetric_d, *m = -8.0f * symmetric_d;
        }
    }
}

/* w [n, k] float (k a multiple of 32); tiles [ceil(n / 8), k / 32, 128];
 * scales, mins [ceil(n / 8), k / 32, 8]. 0, or -1 on bad shapes. */
int heron_pack_q4_tiles(const float *w, int64_t n, int64_t k, uint8_t *tiles, float *scales, float *mins) {
    if (k % 32 != 0 || n < 0) return -1;
    const int64_t nb = k / 32, num_tiles = (n + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *block = tiles + (t * nb + b) * TILE_BLOCK_BYTES;
            memset(block, 0, TILE_BLOCK_BYTES);
            for (int c = 0; c < TILE_COLS; c++) {
                const int64_t row = t * TILE_COLS + c;
                float d = 1.0f, m = 0.0f;
                uint8_t q[32] = {0};
                if (row < n) fit_block(w + row * k + b * 32, q, &d, &m);
                scales[(t * nb + b) * TILE_COLS + c] = d;
                mins[(t * nb + b) * TILE_COLS + c] = m;
                /* input 16 h + 4 (2 nibble + j) + i of column c: byte 64 h + 32 j + 4 c + i */
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 2; j++)
                        for (int i = 0; i < 4; i++)
                            block[64 * h + 32 * j + 4 * c + i] =
                                (uint8_t)(q[16 * h + 4 * j + i] | (q[16 * h + 4 * (j + 2) + i] << 4));
            }
        }
    }
    return 0;
}

/* The int8 layers and both modes' LM head (heron_pack_q8_tiles), as Int8WeightInt8InputLinear's torch formula:
 * per output row, scale = max(max |w|, 1e-8) / 127 and q = clamp(round-half-even(w / scale), -127, 127); rows
 * past n (up to the tiles' multiple of 8) are padding: q = 0, scale = 1. For the embedded model's tied LM head
 * (49152 x 576) 0.3 s of torch ops at every start-up became a few tens of milliseconds.
 * w [n, k] float (k a multiple of 4); tiles [ceil(n / 8), k / 4, 32] int8, byte 4 c + i of group g holding row
 * 8 t + c's input 4 g + i; scales [ceil(n / 8) * 8]. 0, or -1 on bad shapes. */
int heron_pack_q8_tiles(const float *w, int64_t n, int64_t k, int8_t *tiles, float *scales) {
    if (k % 4 != 0 || n < 0) return -1;
    const int64_t groups = k / 4, num_tiles = (n + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        int8_t *tile = tiles + t * groups * 32;
        for (int c = 0; c < TILE_COLS; c++) {
            const int64_t row = t * TILE_COLS + c;
            if (row >= n) {
                scales[row] = 1.0f;
                for (int64_t g = 0; g < groups; g++) memset(tile + g * 32 + 4 * c, 0, 4);
                continue;
            }
            const float *x = w + row * k;
            float amax = 0.0f;
            for (int64_t i = 0; i < k; i++) { /* a comparison, not fmaxf: it vectorizes */
                const float magnitude = fabsf(x[i]);
                amax = magnitude > amax ? magnitude : amax;
            }
            const float scale = (amax > 1e-8f ? amax : 1e-8f) / 127.0f;
            scales[row] = scale;
            for (int64_t g = 0; g < groups; g++)
                for (int i = 0; i < 4; i++) {
                    const float v = nearbyintf(x[4 * g + i] / scale);
                    tile[g * 32 + 4 * c + i] = (int8_t)(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v);
                }
        }
    }
    return 0;
}
