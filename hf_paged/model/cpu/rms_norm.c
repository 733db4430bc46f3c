/* RMSNorm of the Llama family in one pass per row, for CPUs: transformers' LlamaRMSNorm.forward computes
 *
 *     h = x (widened to fp32);  var = mean(h * h);  h = h * rsqrt(var + eps);  out = weight * h.to(x's dtype)
 *
 * as six tensor operations, each a pass over memory and (in a decode step's [rows, hidden] tensors, a few dozen
 * rows) mostly dispatch cost. Here each row is read once to sum its squares and once to write its output, with the
 * same roundings: var = (sum of squares) / n, r = 1 / sqrtf(var + eps) (both correctly rounded, as torch's rsqrt),
 * h = x * r, out = weight * h (fp32); bf16 rows: h rounded to bf16 (to nearest even, as torch's cast), then
 * weight * h (an exact product of two bf16 values) rounded to bf16. The squares are summed in the order of ATen's
 * own vectorized sum (`sum_squares`), so the output is transformers' bit for bit; the engine checks that on random
 * rows before it uses a width (fused_norms.py), for each of the two vector widths ATen may have been built with.
 *
 * x:   [rows, n] rows `x_stride` elements apart, each row contiguous (fp32 or bf16 bits)
 * w:   [n] contiguous, the dtype of x
 * out: [rows, n] contiguous, the dtype of x
 * Rows are spread over OpenMP threads (the libgomp torch loaded) when there are enough elements to pay for it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PARALLEL_ELEMENTS 65536 /* fewer: one thread (a decode step's rows) */

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

/* The sum of h[i]^2 over a row of n fp32 values, added in the order of ATen's vectorized sum over a contiguous last
 * dimension (cascade_sum / row_sum / multi_row_sum in ReduceOps' SumKernel.cpp) for Vectorized<float> of LANES lanes:
 * the row as n / LANES vectors V, four running sums acc[k] += V[4 i + k] (folded into a second level every 16 steps,
 * that into a third every 256, ...), the vectors left over added to acc[0], then acc[0] + acc[1] + acc[2] + acc[3];
 * the scalar tail summed from 0, then the lanes added to it in order. Each square rounded first (h.pow(2)). The
 * engine checks the result against transformers' forward bit for bit before using it (fused_norms). */
#define DEFINE_SUM_SQUARES(NAME, LANES)                                                                              \
    static inline float NAME(const float *restrict h, int64_t n) {                                                    \
        float acc[4][4][LANES]; /* [level][ilp][lane] */                                                             \
        memset(acc, 0, sizeof acc);                                                                                   \
        const int64_t vectors = n / LANES, steps = vectors / 4, step = 16, mask = step - 1;                          \
        int64_t i = 0;                                                                                                \
        for (; i + step <= steps;) {                                                                                  \
            for (int64_t j = 0; j < step; ++j, ++i)                                                                   \
                for (int k = 0; k < 4; ++k)                                                                           \
                    for (int l = 0; l < LANES; ++l) acc[0][k][l] += square(h[(i * 4 + k) * LANES + l]);              \
            for (int level = 1; level < 4; ++level) {                                                                 \
                for (int k = 0; k < 4; ++k)                                                                           \
                    for (int l = 0; l < LANES; ++l) {                                                                 \
                        acc[level][k][l] += acc[level - 1][k][l];                                                     \
                        acc[level - 1][k][l] = 0.f;                                                                   \
                    }                                                                                                 \
                if ((i & (mask << (level * 4))) != 0) break;                                                          \
            }                                                                                                         \
        }                                                                                                             \
        for (; i < steps; ++i)                                                                                        \
            for (int k = 0; k < 4; ++k)                                                                               \
                for (int l = 0; l < LANES; ++l) acc[0][k][l] += square(h[(i * 4 + k) * LANES + l]);                  \
        for (int level = 1; level < 4; ++level)                                                                       \
            for (int k = 0; k < 4; ++k)                                                                               \
                for (int l = 0; l < LANES; ++l) acc[0][k][l] += acc[level][k][l];                                     \
        for (int64_t v = steps * 4; v < vectors; ++v)                                                                 \
            for (int l = 0; l < LANES; ++l) acc[0][0][l] += square(h[v * LANES + l]);                                 \
        for (int k = 1; k < 4; ++k)                                                                                   \
            for (int l = 0; l < LANES; ++l) acc[0][0][l] += acc[0][k][l];                                             \
        float total = 0.f;                                                                                            \
        for (int64_t e = vectors * LANES; e < n; ++e) total += square(h[e]);                                          \
        for (int l = 0; l < LANES; ++l) total += acc[0][0][l];                                                        \
        return total;                                                                                                 \
    }

static inline float square(float v) { return v * v; }
DEFINE_SUM_SQUARES(sum_squares_16, 16)
DEFINE_SUM_SQUARES(sum_squares_8, 8)

static inline float sum_squares(const float *restrict h, int64_t n, int lanes) {
    return lanes == 16 ? sum_squares_16(h, n) : sum_squares_8(h, n);
}

/* The rows of either formula: Llama's out = w * (h * r) (bf16: h * r rounded to bf16 first, as `.to(input_dtype)`,
 * then the product rounded), or, with `gemma`, Gemma's out = ((h * r) * (1 + w)) cast once (GemmaRMSNorm, Gemma 2's
 * and 3's: 1 + w and each product rounded to fp32, bf16 weights widened exactly first). `gemma` is a constant at each
 * call below, so each function gets its own loop. */
static inline void rows_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows, int64_t n,
                            float eps, int lanes, int gemma) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict h = x + r * x_stride;
        float *restrict o = out + r * n;
        const float var = sum_squares(h, n, lanes) / (float)n;
        const float inv = 1.f / sqrtf(var + eps);
        if (gemma)
            for (int64_t i = 0; i < n; ++i) o[i] = (h[i] * inv) * (1.f + w[i]);
        else
            for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (h[i] * inv);
    }
}

static inline void rows_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t rows,
                             int64_t n, float eps, int lanes, int gemma) {
    /* each thread widens its rows into a buffer of its own, sized here: nothing depends on the team's size */
#pragma omp parallel if (rows * n >= PARALLEL_ELEMENTS)
    {
        float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const uint16_t *restrict row = x + r * x_stride;
            uint16_t *restrict o = out + r * n;
            if (h == NULL) { /* cannot happen for sane sizes: a NaN row rather than a crash or a wrong value */
                for (int64_t i = 0; i < n; ++i) o[i] = 0x7fc0;
                continue;
            }
            for (int64_t i = 0; i < n; ++i) h[i] = bf16_to_float(row[i]);
            const float var = sum_squares(h, n, lanes) / (float)n;
            const float inv = 1.f / sqrtf(var + eps);
            if (gemma)
                for (int64_t i = 0; i < n; ++i) o[i] = float_to_bf16((h[i] * inv) * (1.f + bf16_to_float(w[i])));
            else
                for (int64_t i = 0; i < n; ++i) {
                    const float normed = bf16_to_float(float_to_bf16(h[i] * inv)); /* .to(input_dtype) */
                    o[i] = float_to_bf16(bf16_to_float(w[i]) * normed);
                }
        }
        free(h);
    }
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows, int64_t n, float eps,
                  int lanes) {
    rows_f32(x, x_stride, w, out, rows, n, eps, lanes, 0);
}

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t rows, int64_t n,
                   float eps, int lanes) {
    rows_bf16(x, x_stride, w, out, rows, n, eps, lanes, 0);
}

void gemma_rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows, int64_t n,
                        float eps, int lanes) {
    rows_f32(x, x_stride, w, out, rows, n, eps, lanes, 1);
}

void gemma_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t rows,
                         int64_t n, float eps, int lanes) {
    rows_bf16(x, x_stride, w, out, rows, n, eps, lanes, 1);
}
