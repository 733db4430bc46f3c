/* A Mamba (Mamba-1) mixer's selective scan (Mamba, Falcon-Mamba, Jamba) for CPUs, fp32, token by token from a
 * state: decode steps (one token) and prefills alike.
 *
 * transformers' torch code runs a decode step (`mamba_selective_state_update`) as [batch, channels, state size]
 * tensors for dt B, dt B x, the decayed state, their sum and a copy back, and its prefill (`mamba_selective_scan`)
 * as a Python loop over the tokens, a few small tensor operations each. Here, for each sequence b and channel d,
 * token by token:
 *   S[n] <- dA[b][d][t][n] * S[n] + (dt[b][d][t] * B[b][t][n]) * x[b][d][t]
 *   out[b][d][t] = (sum_n S[n] C[b][t][n]  (+ x[b][d][t] * D[d]))  (* gate[b][d][t])
 * where dt is already biased and softplus-ed, gate = silu(z) (the caller computes both with torch, as transformers
 * computes them) and dA = exp(dt A[d][n]) is computed here, dt A rounded as transformers rounds it, the exponential by
 * a degree-6 polynomial of 2^f (within 2 ulp of expf; transformers writes dA for every token, channel and state
 * index: 16 times the tokens' activations). Each product and sum of the state's update is rounded alone (built with
 * -ffp-contract=off), as in transformers' code; the output's sum runs over n in order.
 * state: [B, D, N] contiguous, read as the initial state (zeros where `fresh`) and left as the final one; x, dt,
 * gate, out: [B, D, T]; A: [D, N]; B, C: [B, T, N]; D and gate may be NULL. Sequences times channels are spread over
 * OpenMP threads (the libgomp torch loaded).
 */
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (dt >= 0, A < 0): 2^(x log2 e) split into 2^k 2^f, |f| <= 1/2; below -87 (2^-126) clamped */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.44269504088896341f, k = __builtin_floorf(t + 0.5f), f = t - k;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

void mamba_scan_f32(float *state, int64_t fresh, const float *x, const float *dt, const float *A, const float *B,
                    const float *C, const float *D, const float *gate, float *out, int64_t batch, int64_t channels,
                    int64_t length, int64_t state_size) {
#pragma omp parallel for schedule(static)
    for (int64_t bd = 0; bd < batch * channels; bd++) {
        const int64_t b = bd / channels, d = bd % channels;
        const float *a = A + d * state_size;
        float *s = state + bd * state_size;
        if (fresh)
            for (int64_t n = 0; n < state_size; n++)
                s[n] = 0.f;
        for (int64_t t = 0; t < length; t++) {
            const int64_t at = bd * length + t;
            const float *bi = B + (b * length + t) * state_size, *ci = C + (b * length + t) * state_size;
            const float step = dt[at], xv = x[at];
            for (int64_t n = 0; n < state_size; n++) {  /* (no sum here: this loop vectorizes) */
                const float kept = exp_nonpositive(step * a[n]) * s[n], added = step * bi[n] * xv;
                s[n] = kept + added;
            }
            float sum = 0.f;
            for (int64_t n = 0; n < state_size; n++)
                sum += s[n] * ci[n];
            if (D)
                sum = sum + xv * D[d];
            out[at] = gate ? sum * gate[at] : sum;
        }
    }
}
