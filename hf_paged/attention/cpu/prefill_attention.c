/* Causal attention of one prompt's new tokens on the CPU, fp32 or bf16, for hf_paged's prefill steps
 * (hf_paged/attention/prefill_kernel.py measures it against torch's path and keeps the faster, per shape).
 *
 * q [L, H, D] at positions off .. off + L - 1, k / v [off + L, G, D] (the `off` keys before them: a prefix hit or
 * earlier chunks, then their own; G key/value heads, H % G == 0; rows contiguous), out [L, H, D] in the inputs'
 * dtype; a fresh prompt has off = 0.
 * For each key/value head its keys are laid out transposed and its values as rows, in fp32 (bf16 widened exactly);
 * then for each query head of its group and each block of 16 query rows: the scores of the keys the block's rows
 * may see in 16 x 16 tiles, a softmax per row over its own keys, in fp32, and the rows' outputs as sums of value
 * rows weighted by the probabilities, four rows at a time, divided by the row's sum last; bf16 outputs rounded to
 * nearest even as torch rounds. Position i sees keys lo(i) <= j <= i: lo(i) = 0, raised to i - window + 1 with a
 * sliding `window` (> 0) and to (i / chunk) * chunk with attention `chunk`s (> 0), as hf_paged's `extras.allowed`.
 * With `softcap` > 0 each scaled score s becomes softcap * tanh(s / softcap); with `sinks` (one fp32 logit per query
 * head, or NULL) the head's sink joins each row's softmax denominator (after soft-capping, never scaled) and adds
 * no value, as hf_paged's `_explicit`. The same arithmetic as torch's in another order, with an exp within 3e-7
 * relative (the scores minus their maximum are <= 0; below -87.3 it is taken at -87.3, ~1e-38) and a tanh within
 * 1e-7 absolute (measured over [-40, 40]).
 * Head dims 64, 80, 96, 128 and 256 only (the loops are compiled for each; the outputs are summed DC columns at a
 * time: 64, or the whole row for 80 and 48 twice for 96); `prefill_attend` returns 0 when it ran, -1 for any other
 * head dim (the caller then runs torch's path).
 * The blocks of 16 query rows of a key/value head's query heads are spread over `threads` OpenMP threads (the
 * libgomp torch loaded: built with -fopenmp like the decode kernel), each with its own part of the scratch.
 * scratch: floats, 2 * D * Lp + threads * (16 * D + 16 * Lp), Lp = off + L rounded up to a multiple of 16. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
#endif

#define RB 16 /* query rows per block */
#define KB 16 /* keys per tile */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v; v.u = ((uint32_t)x) << 16; return v.f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch */
    union { uint32_t u; float f; } v; v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    uint32_t lsb = (v.u >> 16) & 1u; v.u += 0x7fffu + lsb; return (uint16_t)(v.u >> 16);
}

/* The decode kernel's polynomial (paged_decode.c's exp_nonpositive) with a rounded-to-even n and the Cody-Waite split
 * of ln 2 in float: kept in this file, as each native source is built and cached alone, by its own hash. */
static inline float exp_neg(float x) {  /* e^x for x <= 0 (below -87.3: e^-87.3), within 3e-7 relative; vectorizable */
    x = x < -87.3f ? -87.3f : x;
    float n = rintf(x * 1.44269504088896341f);  /* to nearest even (the default rounding mode): vectorizes */
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } b; b.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * b.f;
}

/* paged_decode.c's tanh_vec, kept here for the same reason: within 9e-8 absolute (measured over [-40, 40]) */
static inline float tanh_f(float x) {  /* vectorizable */
    float a = x < 0.f ? -x : x, a2 = a * a;
    float e = exp_neg(-2.f * a);
    float far = (1.f - e) / (1.f + e);  /* a >= 1/16: no cancellation worth the name */
    float near = a * (1.f + a2 * (-0.333333343f + a2 * (0.133333340f + a2 * -0.0539682545f)));  /* error < 1e-12 */
    float t = a < 0.0625f ? near : far;
    return x < 0.f ? -t : t;
}

#define LANES 16 /* independent partial maxima and sums: the row loops below vectorize (no chain through one float) */

static inline float row_max(const float *x, int64_t n, float start) {  /* max(start, x[0..n-1]) */
    float mm[LANES];
    for (int c = 0; c < LANES; c++) mm[c] = start;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int c = 0; c < LANES; c++) mm[c] = x[j + c] > mm[c] ? x[j + c] : mm[c];
    for (; j < n; j++) mm[0] = x[j] > mm[0] ? x[j] : mm[0];
    float m = mm[0];
    for (int c = 1; c < LANES; c++) m = mm[c] > m ? mm[c] : m;
    return m;
}

static inline float exp_row(float *x, int64_t n, float m) {  /* x[j] = e^(x[j] - m) for x[j] <= m; their sum */
    float ss[LANES];
    for (int c = 0; c < LANES; c++) ss[c] = 0.f;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int c = 0; c < LANES; c++) { float e = exp_neg(x[j + c] - m); x[j + c] = e; ss[c] += e; }
    for (; j < n; j++) { float e = exp_neg(x[j] - m); x[j] = e; ss[0] += e; }
    float sum = 0.f;
    for (int c = 0; c < LANES; c++) sum += ss[c];
    return sum;
}

static inline int64_t first_key(int64_t i, int64_t window, int64_t chunk) {  /* lo(i) */
    int64_t lo = 0;
    if (window > 0 && i - window + 1 > lo) lo = i - window + 1;
    if (chunk > 0 && i / chunk * chunk > lo) lo = i / chunk * chunk;
    return lo;
}

#define ATTEND(NAME, DD, DC) /* DC: output columns per pass over the values (divides DD) */ \
static void NAME(const void *q_, const void *k_, const void *v_, void *o_, int64_t L, int64_t H, int64_t G, \
                 float scale, int dtype, float *scratch, int threads, int64_t window, int64_t chunk, \
                 float softcap, const float *sinks, int64_t off) { \
    const int64_t D = DD, Lk = off + L; /* keys: the `off` cached ones, then the queries' own */ \
    int64_t Lp = (Lk + KB - 1) / KB * KB; \
    float *kt = scratch;             /* [D][Lp] */ \
    float *vv = kt + D * Lp;         /* [Lp][D] */ \
    int64_t per = H / G, blocks = (L + RB - 1) / RB; \
    for (int64_t g = 0; g < G; g++) { \
        for (int64_t j = 0; j < Lp; j++) { \
            for (int64_t d = 0; d < D; d++) { \
                float kx = 0.f, vx = 0.f; \
                if (j < Lk) { \
                    int64_t at = (j * G + g) * D + d; \
                    kx = dtype ? bf16_to_f32(((const uint16_t *)k_)[at]) : ((const float *)k_)[at]; \
                    vx = dtype ? bf16_to_f32(((const uint16_t *)v_)[at]) : ((const float *)v_)[at]; \
                } \
                kt[d * Lp + j] = kx; \
                vv[j * D + d] = vx; \
            } \
        } \
        _Pragma("omp parallel for schedule(dynamic) num_threads(threads) if(threads > 1)") \
        for (int64_t item = 0; item < per * blocks; item++) { \
            { \
                int64_t h = g * per + item / blocks, r0 = item % blocks * RB; \
                float *qb = vv + Lp * D + (int64_t)omp_get_thread_num() * (RB * D + RB * Lp); /* [RB][D] */ \
                float *s = qb + RB * D;  /* [RB][Lp] */ \
                int64_t rows = L - r0 < RB ? L - r0 : RB; \
                for (int64_t r = 0; r < RB; r++) \
                    for (int64_t d = 0; d < D; d++) { \
                        float x = 0.f; \
                        if (r < rows) { \
                            int64_t at = ((r0 + r) * H + h) * D + d; \
                            x = dtype ? bf16_to_f32(((const uint16_t *)q_)[at]) : ((const float *)q_)[at]; \
                        } \
                        qb[r * D + d] = x * scale; \
                    } \
                int64_t keys = off + r0 + rows;       /* causal: keys up to position off + r0 + rows - 1 */ \
                int64_t lo0 = first_key(off + r0, window, chunk);  /* lo(i) grows with i: the block's first */ \
                int64_t tiles = (keys + KB - 1) / KB, t0 = lo0 / KB, j0 = t0 * KB; \
                for (int64_t t = t0; t < tiles; t++) { \
                    float acc[RB][KB]; \
                    memset(acc, 0, sizeof acc); \
                    for (int d = 0; d < DD; d++) { \
                        const float *kr = kt + d * Lp + t * KB; \
                        for (int r = 0; r < RB; r++) { \
                            float x = qb[r * DD + d]; \
                            for (int c = 0; c < KB; c++) acc[r][c] += x * kr[c]; \
                        } \
                    } \
                    if (softcap > 0.f) { \
                        for (int r = 0; r < RB; r++) \
                            for (int c = 0; c < KB; c++) acc[r][c] = softcap * tanh_f(acc[r][c] / softcap); \
                    } \
                    for (int r = 0; r < RB; r++) memcpy(s + r * Lp + t * KB, acc[r], sizeof acc[r]); \
                } \
                float inv[RB]; \
                for (int64_t r = 0; r < RB; r++) { \
                    float *sr = s + r * Lp; \
                    int64_t n = off + r0 + r + 1, lo = first_key(off + r0 + r, window, chunk); \
                    if (r >= rows) { for (int64_t j = j0; j < keys; j++) sr[j] = 0.f; inv[r] = 0.f; continue; } \
                    float m = row_max(sr + lo, n - lo, sinks ? sinks[h] : -INFINITY); \
                    float sum = exp_row(sr + lo, n - lo, m) + (sinks ? exp_neg(sinks[h] - m) : 0.f); \
                    for (int64_t j = j0; j < lo; j++) sr[j] = 0.f; \
                    for (int64_t j = n; j < keys; j++) sr[j] = 0.f; \
                    inv[r] = 1.f / sum; \
                } \
                for (int64_t r = 0; r < rows; r += 4) \
                    for (int d0 = 0; d0 < DD; d0 += DC) {  /* DC columns at a time: out stays in registers */ \
                        float out[4][DC]; \
                        memset(out, 0, sizeof out); \
                        const float *s0 = s + r * Lp; \
                        for (int64_t j = j0; j < keys; j++) { \
                            const float *vr = vv + j * DD + d0; \
                            for (int rr = 0; rr < 4; rr++) { \
                                float p = s0[rr * Lp + j]; \
                                for (int d = 0; d < DC; d++) out[rr][d] += p * vr[d]; \
                            } \
                        } \
                        for (int rr = 0; rr < 4 && r + rr < rows; rr++) { \
                            int64_t at = ((r0 + r + rr) * H + h) * DD + d0; \
                            float iv = inv[r + rr]; \
                            if (dtype) \
                                for (int d = 0; d < DC; d++) ((uint16_t *)o_)[at + d] = f32_to_bf16(out[rr][d] * iv); \
                            else for (int d = 0; d < DC; d++) ((float *)o_)[at + d] = out[rr][d] * iv; \
                        } \
                    } \
            } \
        } \
    } \
}
ATTEND(attend_64, 64, 64)
ATTEND(attend_80, 80, 80)
ATTEND(attend_96, 96, 48)
ATTEND(attend_128, 128, 64)
ATTEND(attend_256, 256, 64)

int prefill_attend(const void *q, const void *k, const void *v, void *o, int64_t L, int64_t H, int64_t G,
                   int64_t D, float scale, int dtype, float *scratch, int threads, int64_t window, int64_t chunk,
                   float softcap, const float *sinks, int64_t off) {
    if (L <= 0 || off < 0 || G <= 0 || H % G != 0 || threads < 1) return -1;
    if (D == 64) attend_64(q, k, v, o, L, H, G, scale, dtype, scratch, threads, window, chunk, softcap, sinks, off);
    else if (D == 80)
        attend_80(q, k, v, o, L, H, G, scale, dtype, scratch, threads, window, chunk, softcap, sinks, off);
    else if (D == 96)
        attend_96(q, k, v, o, L, H, G, scale, dtype, scratch, threads, window, chunk, softcap, sinks, off);
    else if (D == 128)
        attend_128(q, k, v, o, L, H, G, scale, dtype, scratch, threads, window, chunk, softcap, sinks, off);
    else if (D == 256)
        attend_256(q, k, v, o, L, H, G, scale, dtype, scratch, threads, window, chunk, softcap, sinks, off);
    else return -1;
    return 0;
}
