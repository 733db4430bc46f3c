/* Rotary position embedding of the Llama family for CPUs, in one pass: transformers' apply_rotary_pos_emb computes
 *
 *     out = (x * cos) + (rotate_half(x) * sin),   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
 *
 * as six tensor operations (two slices' copies, a negation, a cat, two products and a sum) for each of q and k.
 * Here each element is one product, another and a sum, rounded as torch rounds them: fp32, each operation to fp32
 * (built without contraction into fused multiply-adds); bf16, each product (exact in fp32 for two bf16 values)
 * rounded to bf16, then the sum computed in fp32 and rounded to bf16, to nearest even as torch's casts. So the
 * output is transformers' bit for bit (tests/test_fused_rotary.py).
 *
 * x, out: [B, H, T, D], element strides (sb, sh, st) each, the last dim contiguous (D even);
 * cos, sin: [B or 1, T, D] with strides (cb, ct), the last dim contiguous (cb 0: one table for every batch row).
 * (b, t) rows are spread over OpenMP threads (the libgomp torch loaded) when there are enough elements.
 */
#include <stdint.h>
#include <string.h>

#define PARALLEL_ELEMENTS 65536

/* The bf16 helpers are rms_norm.c's: each source is built (and its build cached) alone, with no shared header. */

static inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) { /* round to nearest even; NaN stays NaN (branch-free) */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

/* bf16(bf16(value * c) + bf16(partner * s)), each product exact in fp32, the sum in fp32 */
static inline uint16_t rotate_bf16(uint16_t value, float partner, uint16_t c, uint16_t s) {
    const float direct = bf16_to_float(float_to_bf16(bf16_to_float(value) * bf16_to_float(c)));
    const float rotated = bf16_to_float(float_to_bf16(partner * bf16_to_float(s)));
    return float_to_bf16(direct + rotated);
}

void rotary_f32(const float *x, int64_t sb, int64_t sh, int64_t st, const float *cos, const float *sin, int64_t cb,
                int64_t ct, float *out, int64_t ob, int64_t oh, int64_t ot, int64_t batch, int64_t heads,
                int64_t tokens, int64_t dim) {
    const int64_t half = dim / 2;
#pragma omp parallel for collapse(2) schedule(static) if (batch * heads * tokens * dim >= PARALLEL_ELEMENTS)
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t t = 0; t < tokens; ++t) {
            const float *restrict c = cos + b * cb + t * ct, *restrict s = sin + b * cb + t * ct;
            for (int64_t h = 0; h < heads; ++h) {
                const float *restrict row = x + b * sb + h * sh + t * st;
                float *restrict o = out + b * ob + h * oh + t * ot;
                for (int64_t i = 0; i < half; ++i) {
                    const float direct = row[i] * c[i], rotated = -row[i + half] * s[i];
                    o[i] = direct + rotated;
                }
                for (int64_t i = half; i < dim; ++i) {
                    const float direct = row[i] * c[i], rotated = row[i - half] * s[i];
                    o[i] = direct + rotated;
                }
            }
        }
}

void rotary_bf16(const uint16_t *x, int64_t sb, int64_t sh, int64_t st, const uint16_t *cos, const uint16_t *sin,
                 int64_t cb, int64_t ct, uint16_t *out, int64_t ob, int64_t oh, int64_t ot, int64_t batch,
                 int64_t heads, int64_t tokens, int64_t dim) {
    const int64_t half = dim / 2;
#pragma omp parallel for collapse(2) schedule(static) if (batch * heads * tokens * dim >= PARALLEL_ELEMENTS)
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t t = 0; t < tokens; ++t) {
            const uint16_t *restrict c = cos + b * cb + t * ct, *restrict s = sin + b * cb + t * ct;
            for (int64_t h = 0; h < heads; ++h) {
                const uint16_t *restrict row = x + b * sb + h * sh + t * st;
                uint16_t *restrict o = out + b * ob + h * oh + t * ot;
                for (int64_t i = 0; i < half; ++i)
                    o[i] = rotate_bf16(row[i], -bf16_to_float(row[i + half]), c[i], s[i]);
                for (int64_t i = half; i < dim; ++i)
                    o[i] = rotate_bf16(row[i], bf16_to_float(row[i - half]), c[i], s[i]);
            }
        }
}
