/* A batch of float rows rounded to int8 in blocks of 16 (lowbit_input.c):
 * the input of the low-bit kernels of tiled_linear.c. */
#ifndef HERON_LOWBIT_INPUT_H
#define HERON_LOWBIT_INPUT_H
#include <stdint.h>

/* Rows in groups of INPUT_GROUP_ROWS (the kernels' 4-row tiles), interleaved so
 * that a kernel working on a group reaches all of its rows' inputs from one
 * pointer at constant offsets (no row pointer per row: at 4 rows the AVX2 int4
 * kernel ran out of registers for them, spilt and re-added them every block).
 * Per group G and block b of 32 inputs (nb = k / 32 blocks a row):
 *   p [groups, nb, 128] int8: input 16 h + 4 j + i of the group's row r at byte 64 h + 16 j + 4 r + i
 *     (h the half of the block, j its group of 4 inputs);
 *   e [groups, nb, 8]: the half's scale at 4 h + r;
 *   s [groups, nb, 4]: at r, the rounded block's sum e0 * sum p[0:16] + e1 * sum p[16:32].
 * A last group of fewer rows is padded with zeros (no kernel reads them). */
#define INPUT_GROUP_ROWS 4
#define INPUT_BLOCK_BYTES 128 /* a group's bytes per block of 32 inputs */

typedef struct {
    int8_t *p;
    float *e, *s;
} quantized_input;

#define INPUT_BLOCK_SCALES 8 /* a group's scales per block: two halves x INPUT_GROUP_ROWS rows */

/* the inputs, scales and sums of row r's group from its first block on (a kernel steps them a block at a time) */
static inline const int8_t *group_inputs(const quantized_input *in, int64_t r, int64_t nb) {
    return in->p + (r / INPUT_GROUP_ROWS) * nb * INPUT_BLOCK_BYTES;
}
static inline const float *group_scales(const quantized_input *in, int64_t r, int64_t nb) {
    return in->e + (r / INPUT_GROUP_ROWS) * nb * INPUT_BLOCK_SCALES;
}
static inline const float *group_sums(const quantized_input *in, int64_t r, int64_t nb) {
    return in->s + (r / INPUT_GROUP_ROWS) * nb * INPUT_GROUP_ROWS;
}

/* row r's input i */
static inline int8_t input_value(const quantized_input *in, int64_t r, int64_t nb, int64_t i) {
    const int64_t within = i % 32;
    return group_inputs(in, r, nb)[(i / 32) * INPUT_BLOCK_BYTES + (within / 16) * 64 + ((within % 16) / 4) * 16 +
                                   (r % INPUT_GROUP_ROWS) * 4 + within % 4];
}

/* row r's scale of half h of block b */
static inline float input_scale(const quantized_input *in, int64_t r, int64_t nb, int64_t b, int h) {
    return group_scales(in, r, nb)[b * INPUT_BLOCK_SCALES + h * INPUT_GROUP_ROWS + r % INPUT_GROUP_ROWS];
}

/* row r's rounded sum of block b */
static inline float input_sum(const quantized_input *in, int64_t r, int64_t nb, int64_t b) {
    return group_sums(in, r, nb)[b * INPUT_GROUP_ROWS + r % INPUT_GROUP_ROWS];
}

/* 0, or -2 when out of memory (nothing left allocated); k a multiple of 32 */
int heron_quantize_input(const float *x, int64_t rows, int64_t k, quantized_input *in);
void heron_release_input(quantized_input *in);
#endif
