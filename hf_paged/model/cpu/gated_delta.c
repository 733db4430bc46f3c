/* One decode step of Gated DeltaNet layers for CPUs: the short convolution's step and the gated delta rule's step,
 * each one pass over its state per sequence and head, fp32.
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
 *
 * conv_step_f32: the depthwise convolution's step: window[b][c] <- (window[b][c][1:], x[b][c]);
 *   out[b][c] = silu?(sum_j window[b][c][j] w[c][j] + bias[c]).  window: [B, C, W] in place; x, out: [B, C].
 *
 * Sequences (times heads) are spread over OpenMP threads of the libgomp torch loaded. Sums run in index order;
 * only the order of floating-point operations differs from transformers' torch code.
 */
#include <math.h>
#include <stdint.h>

void gdn_step_f32(float *state, const float *q, const float *k, const float *v, const float *g,
                  const float *beta, float *out, int64_t batch, int64_t k_heads, int64_t v_heads, int64_t kd,
                  int64_t vd, int64_t l2norm, float scale) {
    const int64_t group = v_heads / k_heads;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < batch * v_heads; bh++) {
        const int64_t b = bh / v_heads, h = bh % v_heads, kh = h / group;
        const float *qi = q + (b * k_heads + kh) * kd, *ki = k + (b * k_heads + kh) * kd;
        const float *vi = v + bh * vd;
        float *s = state + bh * kd * vd, *o = out + bh * vd;
        float qn[kd], kn[kd], qs[vd], ks[vd], delta[vd];
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
        for (int64_t j = 0; j < vd; j++) {
            qs[j] = 0.f;
            ks[j] = 0.f;
        }
        for (int64_t i = 0; i < kd; i++) {
            const float *row = s + i * vd;
            const float a = qn[i], c = kn[i];
            for (int64_t j = 0; j < vd; j++) {
                qs[j] += a * row[j];
                ks[j] += c * row[j];
            }
        }
        const float decay = expf(g[bh]), bt = beta[bh];
        for (int64_t j = 0; j < vd; j++) {
            delta[j] = (vi[j] - decay * ks[j]) * bt;
            o[j] = decay * qs[j] + qk * delta[j];
        }
        for (int64_t i = 0; i < kd; i++) {
            float *row = s + i * vd;
            const float c = kn[i];
            for (int64_t j = 0; j < vd; j++)
                row[j] = decay * row[j] + c * delta[j];
        }
    }
}

void conv_step_f32(float *window, const float *x, const float *weight, const float *bias, float *out,
                   int64_t batch, int64_t channels, int64_t width, int64_t silu) {
#pragma omp parallel for schedule(static)
    for (int64_t bc = 0; bc < batch * channels; bc++) {
        const int64_t c = bc % channels;
        float *w = window + bc * width;
        const float *kernel = weight + c * width;
        float sum = 0.f;
        for (int64_t j = 0; j + 1 < width; j++) {
            w[j] = w[j + 1];
            sum += w[j] * kernel[j];
        }
        w[width - 1] = x[bc];
        sum += x[bc] * kernel[width - 1];
        if (bias)
            sum += bias[c];
        out[bc] = silu ? sum / (1.f + expf(-sum)) : sum;
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
