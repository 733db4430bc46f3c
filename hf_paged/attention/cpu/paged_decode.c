/* Paged decode attention for CPUs (fp32): one query token per sequence, K/V read in place from the pages.
 *
 * q, out:        [num_seqs, num_heads, head_dim]                contiguous
 * key/value:     [num_blocks, block_size, num_kv_heads, head_dim] contiguous (NHD pages)
 * block_tables:  [num_seqs, max_blocks] int64;  context_lens: [num_seqs] int64 (new token included)
 * scores:        scratch, [num_seqs, num_heads, max_context]
 *
 * Work item = one sequence (sequences [first, last)), spread over OpenMP threads (built with -fopenmp, the
 * library binds to the libgomp torch already loaded, so both share one thread pool). Each token's K and V rows
 * (all kv heads, contiguous) are read once and serve every query head of every GQA group. The query sits at position context_len - 1 (bottom-right);
 * a sliding window keeps keys k > pos - window. Softcap applies tanh(s / cap) * cap to scaled scores.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 (scores minus their maximum), vectorizable: Cody-Waite reduction x = n ln2 + r, a degree-6
 * polynomial for e^r on [-ln2/2, ln2/2] (relative error ~1e-7, like expf), then scaling by 2^n. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

void paged_decode_f32(const float *q, const float *key_cache, const float *value_cache,
                      const int64_t *block_tables, const int64_t *context_lens, float *out, float *scores,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, int64_t max_context, float scale, int64_t window, float softcap,
                      int64_t first, int64_t last) {
    const int64_t per_kv = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* one token's K (or V) for all kv heads: contiguous */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t seq = first; seq < last; ++seq) {
        const int64_t ctx = context_lens[seq];
        const int64_t start = (window > 0 && ctx > window) ? ctx - window : 0;
        const int64_t *table = block_tables + seq * max_blocks;
        const float *qs = q + seq * num_heads * head_dim;
        float *s = scores + seq * num_heads * max_context; /* [num_heads, max_context] */
        float *os = out + seq * num_heads * head_dim;
        for (int64_t t = start; t < ctx; ++t) {
            const float *k = key_cache + (table[t / block_size] * block_size + t % block_size) * row;
            for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
                const float *kh = k + kv * head_dim;
                for (int64_t h = kv * per_kv; h < (kv + 1) * per_kv; ++h) {
                    const float *qh = qs + h * head_dim;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t d = 0; d < head_dim; ++d) acc += qh[d] * kh[d];
                    acc *= scale;
                    if (softcap > 0.f) acc = tanhf(acc / softcap) * softcap;
                    s[h * max_context + t] = acc;
                }
            }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            float *sh = s + h * max_context;
            float top = -INFINITY, total = 0.f;
#pragma omp simd reduction(max : top)
            for (int64_t t = start; t < ctx; ++t) top = sh[t] > top ? sh[t] : top;
#pragma omp simd reduction(+ : total)
            for (int64_t t = start; t < ctx; ++t) { sh[t] = exp_nonpositive(sh[t] - top); total += sh[t]; }
            const float inv = 1.f / total;
#pragma omp simd
            for (int64_t t = start; t < ctx; ++t) sh[t] *= inv;
        }
        for (int64_t i = 0; i < num_heads * head_dim; ++i) os[i] = 0.f;
        for (int64_t t = start; t < ctx; ++t) {
            const float *v = value_cache + (table[t / block_size] * block_size + t % block_size) * row;
            for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
                const float *vh = v + kv * head_dim;
                for (int64_t h = kv * per_kv; h < (kv + 1) * per_kv; ++h) {
                    const float w = s[h * max_context + t];
                    float *o = os + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) o[d] += w * vh[d];
                }
            }
        }
    }
}
