/*
 * Load-time packing of float weights into the int4 layers' column tiles
 * (tiled_linear.c's layout), in one pass: about 10x faster than the torch ops
 * of quantization.py, which compute the same values (they stay the reference
 * and the fallback without a C compiler; the tests check both agree bit for bit).
 *
 * Per output row and block of 32 inputs (GGUF's Q4_1 rule): m = min, d = (max - m) / 15
 * (1 where that is not positive), q = round-half-even((w - m) / d) clamped to 0..15.
 * Rows past n (up to the tiles' multiple of 8) are padding: q = 0, d = 1, m = 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE_COLS 8
#define TILE_BLOCK_BYTES 128

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
                if (row < n) {
                    const float *x = w + row * k + b * 32;
                    float low = x[0], high = x[0];
                    for (int i = 1; i < 32; i++) { /* comparisons, not fminf: they vectorize */
                        low = x[i] < low ? x[i] : low;
                        high = x[i] > high ? x[i] : high;
                    }
                    d = (high - low) / 15.0f;
                    if (!(d > 0.0f)) d = 1.0f;
                    m = low;
                    for (int i = 0; i < 32; i++) {
                        const float v = nearbyintf((x[i] - low) / d);
                        q[i] = (uint8_t)(v < 0.0f ? 0.0f : v > 15.0f ? 15.0f : v);
                    }
                }
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
