/* A batch of float rows rounded to int8 in blocks of 16 (lowbit_input.c):
 * the input of the low-bit kernels of tiled_linear.c. */
#ifndef HERON_LOWBIT_INPUT_H
#define HERON_LOWBIT_INPUT_H
#include <stdint.h>

/* p [rows, k] int8; per block of 32 inputs, e [rows, k / 32, 8] (the low half's
 * scale four times, then the high half's) and s [rows, k / 32] (the rounded
 * block's sum, e0 * sum p[0:16] + e1 * sum p[16:32]) */
typedef struct {
    int8_t *p;
    float *e, *s;
} quantized_input;

/* 0, or -2 when out of memory (nothing left allocated); k a multiple of 32 */
int heron_quantize_input(const float *x, int64_t rows, int64_t k, quantized_input *in);
void heron_release_input(quantized_input *in);
#endif
