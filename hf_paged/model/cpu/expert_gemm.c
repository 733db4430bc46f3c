/* A mixture's expert products for CPUs, with each expert's weight stored input-major, as gpt-oss keeps them
 * ([experts, in, out]): y[i, :] = x[i, :] . w[e] for the rows i of expert e's group.
 *
 * x:    [S, k] fp32 contiguous, sorted by expert (transformers' grouped experts sort them so)
 * w:    [E, k, n] contiguous, fp32 (expert_gemm_f32) or bf16 (expert_gemm_bf16: each weight widened exactly to fp32
 *       in registers, the products and sums in fp32, as oneDNN's bf16 GEMM sums; the caller rounds y to bf16; with
 *       avx512_bf16, expert_gemm_bf16_pairs below multiplies pairs of bf16 in one instruction)
 * ends: [E] cumulative group ends: expert e takes rows ends[e-1] .. ends[e] - 1 (ends[-1] = 0), at most S
 * y:    [S, n] fp32 contiguous; rows past the last end are left to the caller
 * n:    a multiple of 16
 *
 * BLAS sgemm with such a (non-transposed) B of a handful of rows runs far below both the memory bandwidth and the
 * FMA rate (MKL's AVX2 code on an AMD EPYC: ~7 GB/s of weights at 16 rows, where one thread reads 40 GB/s). Here a
 * tile is 64 output columns (four 16-float vectors) of one expert: for each input kk it loads w[e][kk][tile] once
 * and multiplies it by up to ROWS rows' x[i][kk] (broadcast), ROWS x 4 accumulators in registers; the next ROWS rows
 * of the group read the same column panel (k x 64 floats) again, from L2. The first pass prefetches the panel's
 * rows PREFETCH inputs ahead (a constant stride the hardware may not follow across 4 KiB pages). A 16-column tile
 * takes an output width that is no multiple of 64. Tiles (expert, column tile) are spread over `threads` OpenMP
 * threads (the caller's torch thread count; the libgomp torch loaded, one pool).
 *
 * Every output is summed over kk in order in blocks of K_BLOCK, the blocks' partial sums then added: only the order
 * of the floating-point sums differs from BLAS's. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float vec16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t ivec16 __attribute__((vector_size(64)));
typedef uint16_t hvec16 __attribute__((vector_size(32), aligned(2)));

/* 16 fp32 weights: read as they are, or (bf16 weights) 16 bf16 values widened exactly (a bf16 is an fp32's top
 * half). */
ALWAYS_INLINE vec16 load_f32(const float *p) {
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE vec16 load_bf16(const uint16_t *p) {
    hvec16 h;
    memcpy(&h, p, sizeof h);
    const ivec16 bits = __builtin_convertvector(h, ivec16) << 16;
    vec16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

#define ROWS 6       /* rows of x per pass: ROWS x 4 accumulators + 4 weight vectors + 1 broadcast <= 32 registers */
#define K_BLOCK 256  /* inputs summed per partial sum: the rounding error grows with K_BLOCK + k / K_BLOCK, not k */
#define PREFETCH 32  /* panel rows ahead */

/* `rows` (1..ROWS, a constant at each call) rows of x from `x` times the panel w[:, 0 : 16 * VECS] -> y. */
#define DEFINE_PASS(NAME, VECS, W, LOAD)                                                                            \
    ALWAYS_INLINE void NAME(const float *restrict x, const W *restrict w, float *restrict y, int64_t k,            \
                            int64_t n, const int rows, const int prefetch) {                                      \
        vec16 total[ROWS][VECS];                                                                                   \
        memset(total, 0, sizeof total);                                                                            \
        for (int64_t k0 = 0; k0 < k; k0 += K_BLOCK) {                                                              \
            const int64_t k1 = k - k0 < K_BLOCK ? k : k0 + K_BLOCK;                                                \
            vec16 acc[ROWS][VECS];                                                                                 \
            memset(acc, 0, sizeof acc);                                                                            \
            for (int64_t kk = k0; kk < k1; ++kk) {                                                                 \
                const W *wk = w + kk * n;                                                                          \
                if (prefetch && kk + PREFETCH < k)                                                                 \
                    for (int h = 0; h < VECS; ++h) __builtin_prefetch(wk + PREFETCH * n + 16 * h, 0, 2);          \
                vec16 wv[VECS];                                                                                    \
                for (int h = 0; h < VECS; ++h) wv[h] = LOAD(wk + 16 * h);                                          \
                for (int r = 0; r < rows; ++r) {                                                                   \
                    const float s = x[r * k + kk];                                                                 \
                    for (int h = 0; h < VECS; ++h) acc[r][h] += s * wv[h];                                         \
                }                                                                                                  \
            }                                                                                                      \
            for (int r = 0; r < rows; ++r)                                                                         \
                for (int h = 0; h < VECS; ++h) total[r][h] += acc[r][h];                                           \
        }                                                                                                          \
        for (int r = 0; r < rows; ++r)                                                                             \
            for (int h = 0; h < VECS; ++h) memcpy(y + r * n + 16 * h, &total[r][h], sizeof(vec16));               \
    }

/* One tile: the group's `m` rows from x (y) times the panel of `vecs` (4 or 1) vectors at w (rows n apart). */
#define DEFINE_TILE(NAME, W, LOAD)                                                                                  \
    DEFINE_PASS(NAME##_64, 4, W, LOAD)                                                                             \
    DEFINE_PASS(NAME##_16, 1, W, LOAD)                                                                             \
    static void NAME(const float *restrict x, const W *restrict w, float *restrict y, int64_t m, int64_t k,        \
                     int64_t n, int vecs) {                                                                        \
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {                                                                 \
            const int64_t left = m - r0;                                                                           \
            const int prefetch = r0 == 0;                                                                          \
            const float *xr = x + r0 * k;                                                                          \
            float *yr = y + r0 * n;                                                                                \
            switch (left < ROWS ? (int)left : ROWS) {                                                              \
                CASE(NAME, 1) CASE(NAME, 2) CASE(NAME, 3) CASE(NAME, 4) CASE(NAME, 5) CASE(NAME, 6)                \
            }                                                                                                      \
        }                                                                                                          \
    }
#define CASE(NAME, R)                                                                                              \
    case R:                                                                                                        \
        if (vecs == 4)                                                                                             \
            NAME##_64(xr, w, yr, k, n, R, prefetch);                                                               \
        else                                                                                                       \
            NAME##_16(xr, w, yr, k, n, R, prefetch);                                                               \
        break;

DEFINE_TILE(tile_f32, float, load_f32)
DEFINE_TILE(tile_bf16, uint16_t, load_bf16)

/* Every (expert, column tile) of the grouped product, spread over the threads. */
#define DEFINE_GROUPED(NAME, W, TILE)                                                                               \
    void NAME(const float *restrict x, const W *restrict w, float *restrict y, const int64_t *restrict ends,       \
              int64_t experts, int64_t k, int64_t n, int64_t threads) {                                                \
        const int64_t wide = n / 64, tiles = wide + (n - wide * 64) / 16; /* per expert: 64 columns, then 16s */   \
        const int64_t items = experts * tiles;                                                                     \
        _Pragma("omp parallel for schedule(dynamic, 4) num_threads(threads) if(threads > 1)")                          \
        for (int64_t item = 0; item < items; ++item) {                                                             \
            const int64_t e = item / tiles, t = item % tiles;                                                      \
            const int64_t start = e ? ends[e - 1] : 0, end = ends[e];                                              \
            if (end <= start) continue;                                                                            \
            const int64_t col = t < wide ? t * 64 : wide * 64 + (t - wide) * 16;                                   \
            TILE(x + start * k, w + e * k * n + col, y + start * n + col, end - start, k, n, t < wide ? 4 : 1);    \
        }                                                                                                          \
    }

DEFINE_GROUPED(expert_gemm_f32, float, tile_f32)
DEFINE_GROUPED(expert_gemm_bf16, uint16_t, tile_bf16)


#if defined(__AVX512BF16__)
/* Input-major bf16 weights with avx512_bf16 (x kept in bf16, k even, n a multiple of 64): the weight rows kk and kk + 1
 * of 32 columns are interleaved into pairs (unpacklo / unpackhi of 16-bit words: within each 128-bit lane, columns
 * 0-3 and 4-7 of its 8), so that one instruction multiplies each column's pair by x's pair (x[i][kk], x[i][kk + 1])
 * exactly and adds both products to its fp32 sum; the stores put the columns back in order. Sums over kk in pairs,
 * in blocks of K_BLOCK, as the widened kernel's (denormal inputs read as zero, as oneDNN's bf16 GEMM reads them). */
ALWAYS_INLINE void pairs_pass(const uint16_t *restrict x, const uint16_t *restrict w, float *restrict y, int64_t k,
                              int64_t n, const int rows, const int prefetch) {
    __m512 total[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int h = 0; h < 4; ++h) total[r][h] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < k; k0 += K_BLOCK) {
        const int64_t k1 = k - k0 < K_BLOCK ? k : k0 + K_BLOCK;
        __m512 acc[ROWS][4];
        for (int r = 0; r < ROWS; ++r)
            for (int h = 0; h < 4; ++h) acc[r][h] = _mm512_setzero_ps();
        for (int64_t kk = k0; kk < k1; kk += 2) {
            const uint16_t *wa = w + kk * n, *wb = wa + n;
            if (prefetch && kk + PREFETCH + 1 < k)
                for (int h = 0; h < 2; ++h) {
                    __builtin_prefetch(wa + PREFETCH * n + 32 * h, 0, 2);
                    __builtin_prefetch(wb + PREFETCH * n + 32 * h, 0, 2);
                }
            __m512bh wv[4];
            for (int h = 0; h < 2; ++h) {
                const __m512i a = _mm512_loadu_si512(wa + 32 * h), b = _mm512_loadu_si512(wb + 32 * h);
                wv[2 * h] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                wv[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            for (int r = 0; r < rows; ++r) {
                uint32_t pair;
                memcpy(&pair, x + r * k + kk, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int h = 0; h < 4; ++h) acc[r][h] = _mm512_dpbf16_ps(acc[r][h], wv[h], xv);
            }
        }
        for (int r = 0; r < rows; ++r)
            for (int h = 0; h < 4; ++h) total[r][h] = _mm512_add_ps(total[r][h], acc[r][h]);
    }
    /* lo holds columns {0-3, 8-11, 16-19, 24-27} of its 32, hi {4-7, 12-15, 20-23, 28-31} */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int r = 0; r < rows; ++r)
        for (int h = 0; h < 2; ++h) {
            _mm512_storeu_ps(y + r * n + 32 * h, _mm512_permutex2var_ps(total[r][2 * h], first, total[r][2 * h + 1]));
            _mm512_storeu_ps(y + r * n + 32 * h + 16,
                             _mm512_permutex2var_ps(total[r][2 * h], second, total[r][2 * h + 1]));
        }
}

static void pairs_tile(const uint16_t *restrict x, const uint16_t *restrict w, float *restrict y, int64_t m, int64_t k,
                       int64_t n) {
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int64_t left = m - r0;
        const uint16_t *xr = x + r0 * k;
        float *yr = y + r0 * n;
        const int prefetch = r0 == 0;
        switch (left < ROWS ? (int)left : ROWS) {
        case 1: pairs_pass(xr, w, yr, k, n, 1, prefetch); break;
        case 2: pairs_pass(xr, w, yr, k, n, 2, prefetch); break;
        case 3: pairs_pass(xr, w, yr, k, n, 3, prefetch); break;
        case 4: pairs_pass(xr, w, yr, k, n, 4, prefetch); break;
        case 5: pairs_pass(xr, w, yr, k, n, 5, prefetch); break;
        default: pairs_pass(xr, w, yr, k, n, 6, prefetch); break;
        }
    }
}

void expert_gemm_bf16_pairs(const uint16_t *restrict x, const uint16_t *restrict w, float *restrict y,
                            const int64_t *restrict ends, int64_t experts, int64_t k, int64_t n, int64_t threads) {
    const int64_t tiles = n / 64, items = experts * tiles;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t e = item / tiles, col = (item % tiles) * 64;
        const int64_t start = e ? ends[e - 1] : 0, end = ends[e];
        if (end <= start) continue;
        pairs_tile(x + start * k, w + e * k * n + col, y + start * n + col, end - start, k, n);
    }
}
#endif

/* Output-major bf16 weights ([E, n, k], each output's weights contiguous along k: Mixtral, Qwen-MoE), k a multiple
 * of 16: y[i, j] = sum over kk of x[i, kk] w[e][j][kk], dot products along k read straight from x (fp32: widened by
 * the caller; expert_dot_bf16) and from DOT_NB weight rows widened in registers, DOT_ROWS rows of x at a time (the
 * DOT_NB weight rows stay in L1 while the group's rows pass), one horizontal sum per output at the end; the next
 * tile's weight rows are prefetched a cache line per 32 kk. Built where the CPU has avx512_bf16 (-march=native),
 * expert_dot_bf16_pairs takes x in bf16 and multiplies pairs of bf16 in one instruction (k a multiple of 32). */
#define DOT_NB 4
#define DOT_ROWS 4

ALWAYS_INLINE float hsum(vec16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

ALWAYS_INLINE void dot_pass(const float *restrict x, const uint16_t *const wr[DOT_NB], float *restrict y, int64_t k,
                            int64_t n, const int rows, int nb, int prefetch) {
    vec16 acc[DOT_ROWS][DOT_NB];
    memset(acc, 0, sizeof acc);
    for (int64_t kk = 0; kk < k; kk += 16) {
        vec16 wv[DOT_NB];
        for (int b = 0; b < DOT_NB; ++b) {
            if (prefetch && (kk & 31) == 0) __builtin_prefetch(wr[b] + DOT_NB * k + kk, 0, 1);
            wv[b] = load_bf16(wr[b] + kk);
        }
        for (int r = 0; r < rows; ++r) {
            const vec16 xv = load_f32(x + r * k + kk);
            for (int b = 0; b < DOT_NB; ++b) acc[r][b] += xv * wv[b];
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int b = 0; b < nb; ++b) y[r * n + b] = hsum(acc[r][b]);
}

#if defined(__AVX512BF16__)
/* With avx512_bf16 (x kept in bf16, k a multiple of 32): one instruction multiplies 16 pairs of bf16 exactly and adds
 * both products to 16 fp32 sums (denormal inputs read as zero, as oneDNN's bf16 GEMM on such a CPU reads them). */
ALWAYS_INLINE void dot_pass_pairs(const uint16_t *restrict x, const uint16_t *const wr[DOT_NB], float *restrict y,
                                  int64_t k, int64_t n, const int rows, int nb, int prefetch) {
    __m512 acc[DOT_ROWS][DOT_NB];
    for (int r = 0; r < DOT_ROWS; ++r)
        for (int b = 0; b < DOT_NB; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 32) {
        __m512bh wv[DOT_NB];
        for (int b = 0; b < DOT_NB; ++b) {
            if (prefetch) __builtin_prefetch(wr[b] + DOT_NB * k + kk, 0, 1);
            wv[b] = (__m512bh)_mm512_loadu_si512(wr[b] + kk);
        }
        for (int r = 0; r < rows; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + kk);
            for (int b = 0; b < DOT_NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int b = 0; b < nb; ++b) y[r * n + b] = _mm512_reduce_add_ps(acc[r][b]);
}
#endif

/* One tile of DOT_NB outputs (nb of them real) for the group's m rows, x of type XT, through PASS. */
#define DEFINE_DOT(NAME, XT, PASS)                                                                                 \
    static void NAME##_tile(const XT *restrict x, const uint16_t *restrict w, float *restrict y, int64_t m,        \
                            int64_t k, int64_t n, int nb) {                                                        \
        const uint16_t *wr[DOT_NB];                                                                                \
        for (int b = 0; b < DOT_NB; ++b) wr[b] = w + (b < nb ? b : 0) * k; /* a short tile repeats its first */   \
        for (int64_t r0 = 0; r0 < m; r0 += DOT_ROWS) {                                                             \
            const int64_t left = m - r0;                                                                           \
            const XT *xr = x + r0 * k;                                                                             \
            float *yr = y + r0 * n;                                                                                \
            const int prefetch = r0 == 0;                                                                          \
            switch (left < DOT_ROWS ? (int)left : DOT_ROWS) {                                                      \
            case 1: PASS(xr, wr, yr, k, n, 1, nb, prefetch); break;                                                \
            case 2: PASS(xr, wr, yr, k, n, 2, nb, prefetch); break;                                                \
            case 3: PASS(xr, wr, yr, k, n, 3, nb, prefetch); break;                                                \
            default: PASS(xr, wr, yr, k, n, 4, nb, prefetch); break;                                               \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    void NAME(const XT *restrict x, const uint16_t *restrict w, float *restrict y, const int64_t *restrict ends,   \
              int64_t experts, int64_t k, int64_t n, int64_t threads) {                                                \
        const int64_t tiles = (n + DOT_NB - 1) / DOT_NB, items = experts * tiles;                                  \
        _Pragma("omp parallel for schedule(dynamic, 16) num_threads(threads) if(threads > 1)")                         \
        for (int64_t item = 0; item < items; ++item) {                                                             \
            const int64_t e = item / tiles, j0 = (item % tiles) * DOT_NB;                                          \
            const int64_t start = e ? ends[e - 1] : 0, end = ends[e];                                              \
            if (end <= start) continue;                                                                            \
            const int nb = n - j0 < DOT_NB ? (int)(n - j0) : DOT_NB;                                               \
            NAME##_tile(x + start * k, w + (e * n + j0) * k, y + start * n + j0, end - start, k, n, nb);           \
        }                                                                                                          \
    }

DEFINE_DOT(expert_dot_bf16, float, dot_pass)
#if defined(__AVX512BF16__)
DEFINE_DOT(expert_dot_bf16_pairs, uint16_t, dot_pass_pairs)
#endif
