/* Paged decode attention for CPUs: one fp32 query token per sequence, K/V read in place from the pages, which hold
 * fp32 (`paged_decode_f32`) or bf16 (`paged_decode_bf16`: each element widened to fp32 as it is read; the sums run
 * in fp32, as torch's bf16 attention on CPU accumulates).
 *
 * q, out:        [num_seqs, num_heads, head_dim]                contiguous
 * key/value:     [num_blocks, block_size, num_kv_heads, head_dim] contiguous (NHD pages)
 * block_tables:  [num_seqs, max_blocks] int64;  context_lens: [num_seqs] int64 (new token included)
 * scores:        scratch, [num_seqs, num_heads, max_context]
 *
 * Work item = one sequence (all its kv heads: each token's K and V rows are then one contiguous read, a block one
 * run of memory), or one (sequence, kv head) pair when there are too few sequences to keep every thread busy; items
 * are spread over OpenMP threads (built with -fopenmp, the library binds to the libgomp torch already loaded, so both
 * share one thread pool). An item walks its block table block by block once (no per-token division), reads each K
 * row and V row once, prefetching rows a few keys ahead (blocks are scattered: the hardware prefetcher stops at
 * each block's end), and serves all query heads of each GQA group from them. On a 2-vCPU EPYC, 64 sequences of
 * 40-240 keys, 8 layers (K/V far beyond the caches): 8.1 ms per step with an item per kv head and no prefetch,
 * 4.5-4.7 ms with one dot product (and one horizontal sum) per key and head.
 * bf16 pages with head dims that are a multiple of 16 (`decode_item_vec`) take 16-float vectors: scores for 16 keys
 * at a time per query head, whose 16 dot products' lanes one tree of shuffles sums (`lane_sums`), the next keys' K
 * rows and these keys' V rows prefetched a few rows per head, and V weighed with the outputs in registers. On a
 * 2-vCPU AMX Xeon (same 64 sequences, 8 heads / 2 KV heads of 64, 8 layers, one thread, both builds in one process
 * taking turns, fastest of 15): bf16 pages 0.757 -> 0.559 ms per layer. fp32 pages keep the per-key path: there the
 * reads bound the time (9.2 MB per layer at 15 GB/s; this machine reads 20 GB/s sequentially on one thread) and the
 * vector path measured 0.622 against 0.599 ms.
 * The query sits at position pos = context_len - 1 (bottom-right); a sliding window keeps keys k > pos - window,
 * an attention chunk C keys k >= (pos / C) * C. Softcap applies tanh(s / cap) * cap to scaled scores; ALiBi
 * (`alibi`: [num_heads] slopes, or NULL) then adds slope * (k - pos); a sink (`sinks`: [num_heads] logits, or NULL)
 * joins each head's softmax denominator with no value. A key mask (`key_mask`: [num_seqs, mask_stride] bytes, or
 * NULL) leaves out the keys whose byte is 0 (padding in HF's own loop); a row whose keys are all left out gets
 * zeros.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* e^x for x <= 0 (scores minus their maximum), vectorizable: Cody-Waite reduction x = n ln2 + r, a degree-6
 * polynomial for e^r on [-ln2/2, ln2/2] (relative error ~1e-7, like expf), then scaling by 2^n. */
ALWAYS_INLINE float exp_nonpositive(float x) {
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

/* tanh(x) through exp_nonpositive(-2|x|), and its odd series below |x| = 1/16: within 9e-8 absolute and 3.6e-7
 * relative of tanh (measured over [-40, 40]); vectorizable, where libm's tanhf is a call per score. */
ALWAYS_INLINE float tanh_vec(float x) {
    const float a = fabsf(x), a2 = a * a;
    const float e = exp_nonpositive(-2.f * a);
    const float far = (1.f - e) / (1.f + e);
    const float near = a * (1.f + a2 * (-0.333333343f + a2 * (0.133333340f + a2 * -0.0539682545f)));
    const float t = a < 0.0625f ? near : far;
    return x < 0.f ? -t : t;
}

/* A bf16 value widened to fp32 (its 16 bits are the top half of the float's). */
ALWAYS_INLINE float bf16_value(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* The keys an item attends, in order: for each token t in [start, ctx) whose `key_mask` byte is not 0 (every token
 * without a mask), offsets[i] = element offset of its K row (and V row: both caches share one layout) for kv head
 * `kv_offset / head_dim`, tokens[i] = t. Returns their count. The table is walked block by block, so no token pays a
 * division; both passes below then read rows through these offsets. */
static int64_t attended_keys(const int64_t *restrict table, int64_t start, int64_t ctx, int64_t block_size,
                             int64_t row, int64_t kv_offset, const uint8_t *restrict key_mask,
                             int64_t *restrict offsets, int64_t *restrict tokens) {
    int64_t count = 0;
    for (int64_t b = start / block_size, t = start; t < ctx; ++b) {
        const int64_t block_end = (b + 1) * block_size < ctx ? (b + 1) * block_size : ctx;
        const int64_t base = (table[b] * block_size - b * block_size) * row + kv_offset;
        for (; t < block_end; ++t) {
            if (key_mask != NULL && key_mask[t] == 0) continue;
            offsets[count] = base + t * row;
            tokens[count++] = t;
        }
    }
    return count;
}

/* Rows are read through a list of offsets into scattered blocks, which the hardware prefetcher cannot follow across
 * a block boundary: each pass asks for the row PREFETCH_AHEAD keys ahead itself. */
#define PREFETCH_AHEAD 8
ALWAYS_INLINE void prefetch_row(const void *cache, int64_t offset, int64_t elements, int bf16) {
    const char *row = (const char *)cache + offset * (bf16 ? 2 : 4);
    for (int64_t byte = 0; byte < elements * (bf16 ? 2 : 4); byte += 64) __builtin_prefetch(row + byte, 0, 3);
}

/* Each of `heads` score rows (sg, max_context apart) over its `count` keys, in place: softcap, ALiBi, then the softmax
 * (a sink, if any, joins the denominator). */
ALWAYS_INLINE void softmax_rows(float *restrict sg, int64_t heads, int64_t count, int64_t max_context, float softcap,
                                const float *restrict alibi, const int64_t *restrict tokens, int64_t ctx,
                                const float *restrict sinks) {
    for (int64_t g = 0; g < heads; ++g) {
        float *restrict sh = sg + g * max_context;
        if (softcap > 0.f)
            for (int64_t i = 0; i < count; ++i) sh[i] = tanh_vec(sh[i] / softcap) * softcap;
        if (alibi != NULL) {
            const float slope = alibi[g];
            for (int64_t i = 0; i < count; ++i) sh[i] += slope * (float)(tokens[i] - (ctx - 1));
        }
        float top = sinks != NULL ? sinks[g] : -INFINITY, total = 0.f;
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < count; ++i) top = sh[i] > top ? sh[i] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < count; ++i) { sh[i] = exp_nonpositive(sh[i] - top); total += sh[i]; }
        if (sinks != NULL) total += exp_nonpositive(sinks[g] - top);
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t i = 0; i < count; ++i) sh[i] *= inv;
    }
}

ALWAYS_INLINE void prefetch_row_l2(const void *cache, int64_t offset, int64_t elements, int bf16) {
    const char *row = (const char *)cache + offset * (bf16 ? 2 : 4);
    for (int64_t byte = 0; byte < elements * (bf16 ? 2 : 4); byte += 64) __builtin_prefetch(row + byte, 0, 2);
}

/* One item: `num_kv` consecutive kv heads of one sequence (their per_kv query heads each) over its `count` keys.
 * `head_dim` is a compile-time constant at the specialized call sites below, which lets the compiler unroll the
 * per-row loops completely. `offsets`, `tokens` as filled by attended_keys (offsets of the item's first kv head); the
 * query sits at position ctx - 1. */
ALWAYS_INLINE void decode_item(const float *restrict qg, const void *restrict key_cache,
                               const void *restrict value_cache, int bf16, const int64_t *restrict offsets,
                               const int64_t *restrict tokens, float *restrict sg, float *restrict og, int64_t ctx,
                               int64_t count, int64_t per_kv, int64_t num_kv, int64_t head_dim,
                               int64_t max_context, float scale, float softcap, const float *restrict alibi,
                               const float *restrict sinks) {
    const int64_t heads = num_kv * per_kv;
    for (int64_t i = 0; i < heads * head_dim; ++i) og[i] = 0.f;
    if (count == 0) return;
    for (int64_t i = 0; i < count; ++i) {
        if (i + PREFETCH_AHEAD < count) prefetch_row(key_cache, offsets[i + PREFETCH_AHEAD], num_kv * head_dim, bf16);
        for (int64_t kv = 0; kv < num_kv; ++kv) {
            const int64_t at = offsets[i] + kv * head_dim;
            for (int64_t g = kv * per_kv; g < (kv + 1) * per_kv; ++g) {
                const float *restrict qh = qg + g * head_dim;
                float acc = 0.f;
                if (bf16) {
                    const uint16_t *restrict k = (const uint16_t *)key_cache + at;
#pragma omp simd reduction(+ : acc)
                    for (int64_t d = 0; d < head_dim; ++d) acc += qh[d] * bf16_value(k[d]);
                } else {
                    const float *restrict k = (const float *)key_cache + at;
#pragma omp simd reduction(+ : acc)
                    for (int64_t d = 0; d < head_dim; ++d) acc += qh[d] * k[d];
                }
                sg[g * max_context + i] = acc * scale;
            }
        }
    }
    softmax_rows(sg, heads, count, max_context, softcap, alibi, tokens, ctx, sinks);
    for (int64_t i = 0; i < count; ++i) {
        if (i + PREFETCH_AHEAD < count)
            prefetch_row(value_cache, offsets[i + PREFETCH_AHEAD], num_kv * head_dim, bf16);
        for (int64_t kv = 0; kv < num_kv; ++kv) {
            const int64_t at = offsets[i] + kv * head_dim;
            for (int64_t g = kv * per_kv; g < (kv + 1) * per_kv; ++g) {
                const float w = sg[g * max_context + i];
                float *restrict o = og + g * head_dim;
                if (bf16) {
                    const uint16_t *restrict v = (const uint16_t *)value_cache + at;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) o[d] += w * bf16_value(v[d]);
                } else {
                    const float *restrict v = (const float *)value_cache + at;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) o[d] += w * v[d];
                }
            }
        }
    }
}

/* --- head dims that are a multiple of 16: 16-float vectors ------------------------------------------------------- */
typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));
typedef uint16_t half16 __attribute__((vector_size(32)));
typedef uint32_t wide16 __attribute__((vector_size(64)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (ivec16){__VA_ARGS__})
#endif
#define KEYS 16 /* keys whose scores one pass computes */

/* 16 floats of a K or V row from element `at` (bf16 pages: each widened). */
ALWAYS_INLINE vec16 load16(const void *cache, int64_t at, int bf16) {
    vec16 v;
    if (bf16) {
#ifdef __AVX512F__
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + at));
        const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16); /* one instruction each; GCC's vector */
        memcpy(&v, &w, sizeof v);                                           /* conversion took 8 lanes at a time */
#else
        half16 h;
        memcpy(&h, (const uint16_t *)cache + at, sizeof h);
        const wide16 w = __builtin_convertvector(h, wide16) << 16;
        memcpy(&v, &w, sizeof v);
#endif
    } else {
        memcpy(&v, (const float *)cache + at, sizeof v);
    }
    return v;
}

/* r[j] = the sum of a[j]'s 16 lanes, for j < 16, by one fixed tree (lanes l and l + 8 first, then l and l + 4, ...):
 * 15 vector additions instead of 16 horizontal sums. */
ALWAYS_INLINE vec16 lane_sums(const vec16 *a) {
    vec16 b[8], c[4], d[2];
    for (int p = 0; p < 8; ++p)
        b[p] = SHUFFLE(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; ++p)
        c[p] = SHUFFLE(b[2 * p], b[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(b[2 * p], b[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; ++p)
        d[p] = SHUFFLE(c[2 * p], c[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(c[2 * p], c[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Weighted sum of V rows for `nh` heads (first one `h0`, scores sh rows max_context apart) and `nv` vectors of
 * dims from `d0`: each output element summed over the keys in order, accumulators in registers. */
ALWAYS_INLINE void weigh_values(const void *restrict value_cache, int bf16, const int64_t *restrict offsets,
                                int64_t count, int64_t base, const float *restrict sh, int64_t max_context,
                                float *restrict og, int64_t head_dim, int64_t d0, const int nh, const int nv,
                                int prefetch, int64_t row) {
    vec16 acc[4][4];
    for (int h = 0; h < nh; ++h)
        for (int j = 0; j < nv; ++j) acc[h][j] = (vec16){0};
    for (int64_t i = 0; i < count; ++i) {
        if (prefetch && i + PREFETCH_AHEAD < count) prefetch_row(value_cache, offsets[i + PREFETCH_AHEAD], row, bf16);
        vec16 v[4];
        for (int j = 0; j < nv; ++j) v[j] = load16(value_cache, offsets[i] + base + d0 + 16 * j, bf16);
        for (int h = 0; h < nh; ++h) {
            const float w = sh[h * max_context + i];
            for (int j = 0; j < nv; ++j) acc[h][j] += w * v[j];
        }
    }
    for (int h = 0; h < nh; ++h)
        for (int j = 0; j < nv; ++j) memcpy(og + h * head_dim + d0 + 16 * j, &acc[h][j], sizeof(vec16));
}

/* decode_item for head_dim % 16 == 0 (bf16 pages): scores KEYS keys at a time per query head (each K row read from
 * L1 by the group's heads, the dot products' lanes summed by lane_sums), the softmax as before, then V weighed with
 * accumulators in registers in blocks of up to 4 heads x 64 dims, every output summed over the keys in order. */
ALWAYS_INLINE void decode_item_vec(const float *restrict qg, const void *restrict key_cache,
                                   const void *restrict value_cache, int bf16, const int64_t *restrict offsets,
                                   const int64_t *restrict tokens, float *restrict sg, float *restrict og,
                                   int64_t ctx, int64_t count, int64_t per_kv, int64_t num_kv, int64_t head_dim,
                                   int64_t max_context, float scale, float softcap, const float *restrict alibi,
                                   const float *restrict sinks) {
    const int64_t heads = num_kv * per_kv, vecs = head_dim / 16, row = num_kv * head_dim;
    if (count == 0) {
        for (int64_t i = 0; i < heads * head_dim; ++i) og[i] = 0.f;
        return;
    }
    for (int64_t c = 0; c < count; c += KEYS) {
        const int64_t n = count - c < KEYS ? count - c : KEYS;
        for (int64_t kv = 0; kv < num_kv; ++kv) {
            int64_t at[KEYS];
            for (int i = 0; i < KEYS; ++i) at[i] = offsets[c + (i < n ? i : n - 1)] + kv * head_dim;
            for (int64_t g = kv * per_kv; g < (kv + 1) * per_kv; ++g) {
                /* the next chunk's rows, spread over the chunk's (kv head, query head) passes */
                for (int64_t i = c + KEYS + g * KEYS / heads; i < c + KEYS + (g + 1) * KEYS / heads && i < count; ++i)
                    prefetch_row(key_cache, offsets[i], row, bf16);
                for (int64_t i = c + g * KEYS / heads; i < c + (g + 1) * KEYS / heads && i < count; ++i)
                    prefetch_row_l2(value_cache, offsets[i], row, bf16);
                const float *restrict qh = qg + g * head_dim;
                vec16 acc[KEYS];
                for (int i = 0; i < KEYS; ++i) acc[i] = (vec16){0};
                for (int64_t j = 0; j < vecs; ++j) {
                    vec16 qv;
                    memcpy(&qv, qh + 16 * j, sizeof qv);
                    for (int i = 0; i < KEYS; ++i) acc[i] += qv * load16(key_cache, at[i] + 16 * j, bf16);
                }
                const vec16 s = lane_sums(acc) * scale;
                float *restrict out = sg + g * max_context + c;
                if (n == KEYS) {
                    memcpy(out, &s, sizeof s);
                } else {
                    float lanes[KEYS];
                    memcpy(lanes, &s, sizeof s);
                    for (int64_t i = 0; i < n; ++i) out[i] = lanes[i];
                }
            }
        }
    }
    softmax_rows(sg, heads, count, max_context, softcap, alibi, tokens, ctx, sinks);
    for (int64_t kv = 0; kv < num_kv; ++kv)
        for (int64_t h0 = 0; h0 < per_kv; h0 += 4) {
            const int64_t g = kv * per_kv + h0, nh = per_kv - h0 < 4 ? per_kv - h0 : 4;
            for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
                const int64_t nv = (head_dim - d0) / 16 < 4 ? (head_dim - d0) / 16 : 4;
                const int prefetch = kv == 0 && h0 == 0 && d0 == 0; /* the first sweep over the keys */
#define WEIGH(NH, NV) weigh_values(value_cache, bf16, offsets, count, kv * head_dim, sg + g * max_context, \
                                   max_context, og + g * head_dim, head_dim, d0, NH, NV, prefetch, row)
#define WEIGH_NH(NV) switch (nh) { case 1: WEIGH(1, NV); break; case 2: WEIGH(2, NV); break; \
                                   case 3: WEIGH(3, NV); break; default: WEIGH(4, NV); break; }
                switch (nv) {
                    case 1: WEIGH_NH(1); break;
                    case 2: WEIGH_NH(2); break;
                    case 3: WEIGH_NH(3); break;
                    default: WEIGH_NH(4); break;
                }
#undef WEIGH_NH
#undef WEIGH
            }
        }
}

ALWAYS_INLINE void paged_decode(const float *q, const void *key_cache, const void *value_cache, int bf16,
                              int64_t path, const int64_t *block_tables, const int64_t *context_lens, float *out,
                              float *scores,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              int64_t max_blocks, int64_t max_context, float scale, int64_t window, float softcap,
                              const float *alibi, const float *sinks, int64_t chunk, const uint8_t *key_mask,
                              int64_t mask_stride, int64_t first, int64_t last) {
    const int64_t per_kv = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* one token's K (or V) for all kv heads: contiguous */
    /* Enough sequences to keep every thread busy: an item is a whole sequence, which reads each token's K and V
     * rows of all kv heads as one contiguous stretch (a block is then one run of memory). Otherwise an item is one
     * kv head of a sequence, so few sequences still spread over the threads. */
    const int64_t kv_per_item = last - first >= 4 * omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / kv_per_item;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = first * items_per_seq; item < last * items_per_seq; ++item) {
        const int64_t seq = item / items_per_seq, kv = item % items_per_seq * kv_per_item;
        const int64_t ctx = context_lens[seq];
        int64_t start = (window > 0 && ctx > window) ? ctx - window : 0;
        if (chunk > 0 && (ctx - 1) / chunk * chunk > start) start = (ctx - 1) / chunk * chunk;
        const int64_t head0 = seq * num_heads + kv * per_kv; /* first query head of the item */
        const float *qg = q + head0 * head_dim;
        float *sg = scores + head0 * max_context;
        float *og = out + head0 * head_dim;
        int64_t *offsets = malloc((size_t)(ctx - start) * 2 * sizeof *offsets);
        if (offsets == NULL) { /* cannot happen for sane sizes; leave a NaN row rather than crash the process */
            for (int64_t i = 0; i < kv_per_item * per_kv * head_dim; ++i) og[i] = NAN;
            continue;
        }
        int64_t *tokens = offsets + (ctx - start);
        const uint8_t *mask = key_mask != NULL ? key_mask + seq * mask_stride : NULL;
        const int64_t count = attended_keys(block_tables + seq * max_blocks, start, ctx, block_size, row,
                                            kv * head_dim, mask, offsets, tokens);
        const float *alibi_g = alibi != NULL ? alibi + kv * per_kv : NULL;
        const float *sinks_g = sinks != NULL ? sinks + kv * per_kv : NULL;
#define ITEM(D) decode_item(qg, key_cache, value_cache, bf16, offsets, tokens, sg, og, ctx, count, per_kv, \
                            kv_per_item, D, max_context, scale, softcap, alibi_g, sinks_g)
#define ITEM_VEC(D) decode_item_vec(qg, key_cache, value_cache, bf16, offsets, tokens, sg, og, ctx, count, per_kv, \
                                   kv_per_item, D, max_context, scale, softcap, alibi_g, sinks_g)
        /* path 0: by dtype (bf16 pages: the sums, not the reads, bound the time: the vector path); 1: per key; 2: the
         * vector path (head_dim a multiple of 16, else per key). The caller's timed probe picks (decode_choice.py). */
        if (head_dim % 16 == 0 && (path == 2 || (path == 0 && bf16))) {
            switch (head_dim) {
                case 64: ITEM_VEC(64); break;
                case 128: ITEM_VEC(128); break;
                default: ITEM_VEC(head_dim); break;
            }
        } else {
            switch (head_dim) {
                case 64: ITEM(64); break;
                case 128: ITEM(128); break;
                default: ITEM(head_dim); break;
            }
        }
#undef ITEM_VEC
        free(offsets);
#undef ITEM
    }
}

#define PAGED_DECODE_ARGS(KV_T)                                                                                     \
    const float *q, const KV_T *key_cache, const KV_T *value_cache, const int64_t *block_tables,                  \
    const int64_t *context_lens, float *out, float *scores, int64_t num_heads, int64_t num_kv_heads,               \
    int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t max_context, float scale, int64_t window,    \
    float softcap, const float *alibi, const float *sinks, int64_t chunk, const uint8_t *key_mask,                 \
    int64_t mask_stride, int64_t first, int64_t last, int64_t path
#define PAGED_DECODE_CALL(BF16)                                                                                     \
    paged_decode(q, key_cache, value_cache, BF16, path, block_tables, context_lens, out, scores, num_heads,        \
                 num_kv_heads, head_dim, block_size, max_blocks, max_context, scale, window, softcap, alibi, sinks, \
                 chunk, key_mask, mask_stride, first, last)

void paged_decode_f32(PAGED_DECODE_ARGS(float)) { PAGED_DECODE_CALL(0); }
void paged_decode_bf16(PAGED_DECODE_ARGS(uint16_t)) { PAGED_DECODE_CALL(1); }
