/* A Mamba-2 mixer's selective scan (state space duality: Mamba-2, Nemotron-H, Falcon-H1, Bamba, Granite-4 hybrids,
 * Zamba2) for CPUs, in fp32 (a bf16 model's inputs widened), token by token from a state: decode steps (one token)
 * and prefills alike.
 *
 * transformers' torch code runs a decode step (`mamba2_selective_state_update`) as state-sized tensors for
 * exp(dt A), dt B, dt B x, the decayed state, their sum and a copy back, each a pass over [batch, heads, head dim,
 * state size] floats (for 64 sequences of a 16-head layer with 128-wide states, 33 MB a pass); its prefill
 * (`mamba2_chunk_scan`) in blocks of chunk-size tokens, matrix products over each block, C B^T again for every head
 * of a group. Here, for each sequence b and head h (its group g = h / (heads / groups)), token by token:
 *   dB[n]    = dt[b][t][h] * B[b][t][g][n]
 *   S[p][n] <- S[p][n] * decay[b][t][h] + dB[n] * x[b][t][h][p]          (in place)
 *   out[b][t][h][p] = sum_n S[p][n] C[b][t][g][n]  (+ x[b][t][h][p] * D[h])
 * where dt is already biased, softplus-ed (and clamped, for a prefill) and decay = exp(dt A): the caller computes
 * both on [batch, tokens, heads]. A head's state (head dim x state size floats, 32 KB at 64 x 128) stays in the
 * core's cache for all of its tokens. The state's update rounds as transformers' recurrent form does (each product
 * and the sum rounded alone: built with -ffp-contract=off); the output's sum runs in 16 lanes, then the lanes in
 * order. state: [B, H, P, N] contiguous, read as the initial state (zeros where `fresh`) and left as the final one;
 * x, out: [B, T, H, P]; dt, decay: [B, T, H]; B, C: [B, T, G, N]; D: [H] or NULL; `half`: a bf16 model's decode
 * (see scan_head). Sequences times heads are spread over OpenMP threads (the libgomp torch loaded).
 */
#include <stdint.h>
#include <string.h>

#define LANES 16

/* f rounded to the nearest bfloat16 (ties to even), as a float */
static inline float to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One sequence's head over its tokens. `half`: the products dt B and dt B x, the state as the output's product reads
 * it, that product and x D rounded to bfloat16 as transformers' recurrent form computes them for a bf16 model (its
 * state stays fp32); the inputs are then bf16 values held in floats. */
static inline __attribute__((always_inline)) void scan_head(float *s0, const float *x, const float *dt,
        const float *decay, const float *B, const float *C, const float *D, float *out, int64_t b, int64_t h,
        int64_t g, int64_t length, int64_t heads, int64_t head_dim, int64_t groups, int64_t state_size, const int half) {
    const int64_t whole = state_size / LANES * LANES;
    float db[state_size];
    for (int64_t t = 0; t < length; t++) {
        const int64_t bt = b * length + t;
        const float *bi = B + (bt * groups + g) * state_size, *ci = C + (bt * groups + g) * state_size;
        const float *xi = x + (bt * heads + h) * head_dim, step = dt[bt * heads + h], a = decay[bt * heads + h];
        float *o = out + (bt * heads + h) * head_dim, *s = s0;
        for (int64_t n = 0; n < state_size; n++)
            db[n] = half ? to_bf16(step * bi[n]) : step * bi[n];
        for (int64_t p = 0; p < head_dim; p++, s += state_size) {
            const float xv = xi[p];
            float lanes[LANES] = {0.f};
            for (int64_t n0 = 0; n0 < whole; n0 += LANES)
                for (int j = 0; j < LANES; j++) {
                    const float kept = s[n0 + j] * a, product = db[n0 + j] * xv;
                    const float v = kept + (half ? to_bf16(product) : product);
                    s[n0 + j] = v;
                    lanes[j] += (half ? to_bf16(v) : v) * ci[n0 + j];
                }
            float sum = 0.f;
            for (int j = 0; j < LANES; j++)
                sum += lanes[j];
            for (int64_t n = whole; n < state_size; n++) {
                const float kept = s[n] * a, product = db[n] * xv, v = kept + (half ? to_bf16(product) : product);
                s[n] = v;
                sum += (half ? to_bf16(v) : v) * ci[n];
            }
            if (half)
                o[p] = D ? to_bf16(to_bf16(sum) + to_bf16(xv * D[h])) : to_bf16(sum);
            else
                o[p] = D ? sum + xv * D[h] : sum;
        }
    }
}

void ssd_scan_f32(float *state, int64_t fresh, const float *x, const float *dt, const float *decay, const float *B,
                  const float *C, const float *D, float *out, int64_t batch, int64_t length, int64_t heads,
                  int64_t head_dim, int64_t groups, int64_t state_size, int64_t half) {
    const int64_t per_group = heads / groups;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads, h = bh % heads, g = h / per_group;
        float *s0 = state + bh * head_dim * state_size;
        if (fresh)
            for (int64_t i = 0; i < head_dim * state_size; i++)
                s0[i] = 0.f;
        if (half)
            scan_head(s0, x, dt, decay, B, C, D, out, b, h, g, length, heads, head_dim, groups, state_size, 1);
        else
            scan_head(s0, x, dt, decay, B, C, D, out, b, h, g, length, heads, head_dim, groups, state_size, 0);
    }
}
