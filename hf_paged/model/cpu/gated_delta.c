/* Gated DeltaNet layers for CPUs: the short convolution's step and the gated delta rule's step (a decode), each one
 * pass over its state per sequence and head, fp32 (the convolution's step also bf16), and the rule over a sequence
 * of tokens (a prefill) as the same step token by token.
 *
 * transformers' torch code runs a decode step as a dozen small tensor operations per layer (normalize q and k,
 * decay, two products each summed over the key dimension, an outer product added), each reading and writing a
 * state-sized or row-sized tensor; for a batch of decodes these calls cost more than the arithmetic. Here one
 * call does a layer's step for every sequence:
 *
 * gdn_step_f32: for each sequence b and value head h (its key head h / (hv / hk)):
 *   q, k  <- q / |q|, k / |k| (if l2norm; |x| = sqrt(sum x^2 + 1e-6)), q <- q * scale
 *   qs[v] = sum_k q[k] S[k][v],  ks[v] = sum_k k[k] S[k][v]          (one pass over S, rows in order)
 *   decay = exp(g),  delta[v] = (v[v] - decay ks[v]) beta
 *   out[v] = decay qs[v] + (q . k) delta[v]                          (= q . S' below)
 *   S[k][v] <- decay S[k][v] + k[k] delta[v]                          (the second pass, S still in L1/L2)
 * S: [B, hv, K, V] contiguous, updated in place; q, k: [B, hk, K]; v, out: [B, hv, V]; g, beta: [B, hv].
 * gdn_seq_f32: the same for L tokens of each sequence, in order (see its comment).
 *
 * conv_step_f32: the depthwise convolution's step: window[b][c] <- (window[b][c][1:], x[b][c]);
 *   out[b][c] = silu?(sum_j window[b][c][j] w[c][j] + bias[c]).  window: [B, C, W] in place; x, out: [B, C].
 *   (Kernel widths 2-4 compiled apart, vectorized over channels: 1.6-1.9x the loop for any width on one EPYC thread.)
 *   The bias first, then the taps in order, as conv_seq_f32 sums: a token's output is the same bits whether a decode
 *   step or a prefill (a recompute after preemption) computes it.
 *
 * Sequences (times heads) are spread over OpenMP threads of the libgomp torch loaded. Sums run in index order;
 * only the order of floating-point operations differs from transformers' torch code.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* One token of one sequence's value head: the step above on its state s [K, V]. Both passes over s go in blocks of
 * BLOCK value columns whose sums stay in registers across the whole key dimension. */
#define BLOCK 32
static inline void gdn_token(float *restrict s, const float *restrict qi, const float *restrict ki,
                             const float *restrict vi, float g, float bt, float *restrict o, int64_t kd, int64_t vd,
                             int64_t l2norm, float scale) {
    float qn[kd], kn[kd], delta[vd];
    float qq = 0.f, kk = 0.f;
    for (int64_t i = 0; i < kd; i++) {
        qq += qi[i] * qi[i];
        kk += ki[i] * ki[i];
    }
    const float qf = (l2norm ? 1.f / sqrtf(qq + 1e-6f) : 1.f) * scale;
    const float kf = l2norm ? 1.f / sqrtf(kk + 1e-6f) : 1.f;
    float qk = 0.f;
    for (int64_t i = 0; i < kd; i++) {
        qn[i] = qi[i] * qf;
        kn[i] = ki[i] * kf;
        qk += qn[i] * kn[i];
    }
    const float decay = expf(g);
    int64_t j0 = 0;
    for (; j0 + BLOCK <= vd; j0 += BLOCK) {
        float qs[BLOCK] = {0.f}, ks[BLOCK] = {0.f};
        for (int64_t i = 0; i < kd; i++) {
            const float *row = s + i * vd + j0;
            const float a = qn[i], c = kn[i];
            for (int64_t j = 0; j < BLOCK; j++) {
                qs[j] += a * row[j];
                ks[j] += c * row[j];
            }
        }
        for (int64_t j = 0; j < BLOCK; j++) {
            delta[j0 + j] = (vi[j0 + j] - decay * ks[j]) * bt;
            o[j0 + j] = decay * qs[j] + qk * delta[j0 + j];
        }
    }
    for (; j0 < vd; j0++) {  /* value dims past the last whole block */
        float qs = 0.f, ks = 0.f;
        for (int64_t i = 0; i < kd; i++) {
            qs += qn[i] * s[i * vd + j0];
            ks += kn[i] * s[i * vd + j0];
        }
        delta[j0] = (vi[j0] - decay * ks) * bt;
        o[j0] = decay * qs + qk * delta[j0];
    }
    for (int64_t i = 0; i < kd; i++) {
        float *row = s + i * vd;
        const float c = kn[i];
        for (int64_t j = 0; j < vd; j++)
            row[j] = decay * row[j] + c * delta[j];
    }
}

void gdn_step_f32(float *state, const float *q, const float *k, const float *v, const float *g,
                  const float *beta, float *out, int64_t batch, int64_t k_heads, int64_t v_heads, int64_t kd,
                  int64_t vd, int64_t l2norm, float scale) {
    const int64_t group = v_heads / k_heads;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < batch * v_heads; bh++) {
        const int64_t b = bh / v_heads, kh = bh % v_heads / group;
        gdn_token(state + bh * kd * vd, q + (b * k_heads + kh) * kd, k + (b * k_heads + kh) * kd, v + bh * vd,
                  g[bh], beta[bh], out + bh * vd, kd, vd, l2norm, scale);
    }
}

/* gdn_seq_f32: `length` tokens of each sequence in turn from its state (a prefill, a chunk), token by token (the
 * recurrent form: per token and head the same multiply-adds on the state as the chunked form's state products, with
 * the head's state kept in cache from token to token, where the chunked form passes every sequence's state through
 * memory once per chunk). q, k: [B, L, hk, K]; v, out: [B, L, hv, V]; g, beta: [B, L, hv]; state as above. */
void gdn_seq_f32(float *state, const float *q, const float *k, const float *v, const float *g, const float *beta,
                 float *out, int64_t batch, int64_t length, int64_t k_heads, int64_t v_heads, int64_t kd,
                 int64_t vd, int64_t l2norm, float scale) {
    const int64_t group = v_heads / k_heads;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < batch * v_heads; bh++) {
        const int64_t b = bh / v_heads, h = bh % v_heads, kh = h / group;
        float *s = state + bh * kd * vd;
        for (int64_t t = 0; t < length; t++) {
            const int64_t bt = b * length + t;  /* the token's row */
            gdn_token(s, q + (bt * k_heads + kh) * kd, k + (bt * k_heads + kh) * kd, v + (bt * v_heads + h) * vd,
                      g[bt * v_heads + h], beta[bt * v_heads + h], out + (bt * v_heads + h) * vd, kd, vd, l2norm,
                      scale);
        }
    }
}

/* The convolutions below sum in the order written (no reassociation; products fused into their sums alike), so
 * that a decode step and a prefill give a token the same bits. */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
/* The step of one sequence's channels for a window of W columns known when compiled (the common kernel sizes: the
 * loop over channels then vectorizes), before any activation. */
#define CONV_STEP(W)                                                                                          \
    static void conv_step_w##W(float *restrict window, const float *restrict x, const float *restrict weight, \
                               const float *restrict bias, float *restrict out, int64_t channels) {           \
        for (int64_t c = 0; c < channels; c++) {                                                              \
            float *w = window + c * W;                                                                        \
            const float *kernel = weight + c * W;                                                             \
            float sum = bias ? bias[c] : 0.f;                                                                 \
            for (int64_t j = 0; j + 1 < W; j++) {                                                             \
                w[j] = w[j + 1];                                                                              \
                sum += w[j] * kernel[j];                                                                      \
            }                                                                                                 \
            w[W - 1] = x[c];                                                                                  \
            out[c] = sum + x[c] * kernel[W - 1];                                                              \
        }                                                                                                     \
    }
CONV_STEP(2)
CONV_STEP(3)
CONV_STEP(4)

void conv_step_f32(float *window, const float *x, const float *weight, const float *bias, float *out,
                   int64_t batch, int64_t channels, int64_t width, int64_t silu) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        float *wb = window + b * channels * width, *ob = out + b * channels;
        const float *xb = x + b * channels;
        if (width == 2)
            conv_step_w2(wb, xb, weight, bias, ob, channels);
        else if (width == 3)
            conv_step_w3(wb, xb, weight, bias, ob, channels);
        else if (width == 4)
            conv_step_w4(wb, xb, weight, bias, ob, channels);
        else {  /* any other width: tap by tap over the channels, each sum fused in order as conv_seq_f32's */
            for (int64_t c = 0; c < channels; c++)
                ob[c] = bias ? bias[c] : 0.f;
            for (int64_t j = 0; j + 1 < width; j++)
                for (int64_t c = 0; c < channels; c++)
                    ob[c] += wb[c * width + j + 1] * weight[c * width + j];
            for (int64_t c = 0; c < channels; c++) {
                float *w = wb + c * width;
                ob[c] += xb[c] * weight[c * width + width - 1];
                for (int64_t j = 0; j + 1 < width; j++)
                    w[j] = w[j + 1];
                w[width - 1] = xb[c];
            }
        }
        if (silu)  /* a pass of its own: the sums' loop above stays free of the call */
            for (int64_t c = 0; c < channels; c++)
                ob[c] = ob[c] / (1.f + expf(-ob[c]));
    }
}

/* conv_step_bf16: the same step on bf16 windows, inputs and weights (a bf16 model): the products summed in fp32 with
 * the bias, rounded to bf16 (as a bf16 convolution's output), then SiLU of that value rounded again (as torch's
 * SiLU on a bf16 tensor). Arguments as conv_step_f32's, bf16 bits. */
static inline float from_bf16(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline uint16_t to_bf16(float value) {  /* to nearest, ties to even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0u;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

void conv_step_bf16(uint16_t *window, const uint16_t *x, const uint16_t *weight, const uint16_t *bias,
                    uint16_t *out, int64_t batch, int64_t channels, int64_t width, int64_t silu) {
#pragma omp parallel for schedule(static)
    for (int64_t bc = 0; bc < batch * channels; bc++) {
        const int64_t c = bc % channels;
        uint16_t *w = window + bc * width;
        const uint16_t *kernel = weight + c * width;
        float sum = 0.f;
        for (int64_t j = 0; j + 1 < width; j++) {
            w[j] = w[j + 1];
            sum += from_bf16(w[j]) * from_bf16(kernel[j]);
        }
        w[width - 1] = x[bc];
        sum += from_bf16(x[bc]) * from_bf16(kernel[width - 1]);
        if (bias)
            sum += from_bf16(bias[c]);
        uint16_t result = to_bf16(sum);
        if (silu) {
            const float v = from_bf16(result);
            result = to_bf16(v / (1.f + expf(-v)));
        }
        out[bc] = result;
    }
}

/* conv_seq_f32: the depthwise causal convolution over a sequence, channels last: x [B, T, C] (the stored window's
 * columns first), weight_t [W, C] (the kernel transposed), out [B, S, C] the last S outputs:
 *   out[b][s][c] = silu?(sum_j x[b][T - S + s - (W-1) + j][c] weight_t[j][c] + bias[c]),
 * columns before the start counting as zero (transformers pads the input with W - 1 zeros on the left). */
void conv_seq_f32(const float *x, const float *weight_t, const float *bias, float *out, int64_t batch,
                  int64_t channels, int64_t length, int64_t width, int64_t outputs, int64_t silu) {
#pragma omp parallel for schedule(static)
    for (int64_t bs = 0; bs < batch * outputs; bs++) {
        const int64_t b = bs / outputs, s = bs % outputs;
        const int64_t first = length - outputs + s - (width - 1);  /* the input column of this output's first tap */
        float *o = out + bs * channels;
        for (int64_t c = 0; c < channels; c++)
            o[c] = bias ? bias[c] : 0.f;
        for (int64_t j = 0; j < width; j++) {
            if (first + j < 0)
                continue;
            const float *column = x + (b * length + first + j) * channels, *tap = weight_t + j * channels;
            for (int64_t c = 0; c < channels; c++)
                o[c] += column[c] * tap[c];
        }
        if (silu)
            for (int64_t c = 0; c < channels; c++)
                o[c] = o[c] / (1.f + expf(-o[c]));
    }
}
#pragma GCC pop_options
