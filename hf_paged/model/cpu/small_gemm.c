/* Few-row fp32 linear layers for CPUs: y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]), for m up to a few dozen rows.
 *
 * A decode step multiplies a handful of rows by every weight of the model. BLAS sgemm handles such skinny
 * products far below both the memory bandwidth and the FMA throughput; this kernel streams each weight row once.
 *
 * x:      [m, k] rows `x_stride` floats apart, each row contiguous
 * w:      [n, k] contiguous (torch.nn.Linear's weight)
 * bias:   [n] or NULL
 * y:      [m, n] contiguous
 * packed: scratch of k * mp floats, mp = m rounded up to a multiple of 16
 *
 * Up to 8 rows of x: dot products along k, read straight from x, four rows at a time (`few_rows`). More rows:
 * first x is packed transposed (packed[kk * mp + i] = x[i, kk], padding rows zero), so that one 16-float vector
 * holds 16 rows' values of one input feature. A tile then takes NB weight rows (output features) and 16 or 32
 * rows of x: for each kk it broadcasts w[j, kk] against the vector(s) of packed row kk and accumulates NB x 16
 * (or NB x 32) outputs in registers; the NB weight rows stay in L1 while the tile walks over the rows of x.
 * Tiles of output features are spread over OpenMP threads (the libgomp torch loaded, one pool). Every output is
 * summed over kk in order in blocks of K_BLOCK, the blocks' partial sums then added: only the order of the
 * floating-point sums differs from BLAS.
 *
 * Weights stream from memory (a decode step reads every weight once; 153 MB for the benchmark model, far beyond
 * the caches): while a tile computes, it prefetches the next tile's weight rows, a cache line per 16 inputs, into
 * L2 (locality 1; prefetching into L1 as well measured 10-30 % slower for 1-16 rows). On a 2-vCPU EPYC,
 * against no prefetch (fastest of 8, interleaved; 8 layers' linears of the benchmark model / LM head [32000, 512]):
 * 1 row 3.65 -> 2.88 / 2.52 -> 1.87 ms, 4 rows 5.24 -> 3.23 / 3.85 -> 2.16 ms, 16 rows 6.12 -> 4.73 / 4.22 -> 3.00
 * ms, 64 rows 18.6 -> 16.8 / 12.5 -> 11.3 ms.
 */
#include <stdint.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64), aligned(4)));

#define NB 8        /* weight rows per tile */
#define K_BLOCK 128 /* inputs summed per partial sum: the rounding error grows with K_BLOCK + k / K_BLOCK, not k */

#define DEFINE_TILE(NAME, VECS)                                                                                      \
    static inline void NAME(const float *restrict packed, const float *restrict w, const float *restrict bias,     \
                            float *restrict y, int64_t m, int64_t mp, int64_t n, int64_t k, int64_t j0, int64_t nb, \
                            int64_t row0) {                                                                          \
        vec16 total[NB][VECS];                                                                                       \
        memset(total, 0, sizeof total);                                                                              \
        const float *rows[NB];                                                                                       \
        for (int b = 0; b < NB; ++b) rows[b] = w + (j0 + (b < nb ? b : 0)) * k; /* short tile: repeat row j0 */     \
        for (int64_t k0 = 0; k0 < k; k0 += K_BLOCK) {                                                                \
            const int64_t k1 = k - k0 < K_BLOCK ? k : k0 + K_BLOCK;                                                  \
            vec16 acc[NB][VECS];                                                                                     \
            memset(acc, 0, sizeof acc);                                                                              \
            for (int64_t kk = k0; kk < k1; ++kk) {                                                                   \
                vec16 xv[VECS];                                                                                      \
                for (int h = 0; h < VECS; ++h) memcpy(&xv[h], packed + kk * mp + row0 + 16 * h, sizeof(vec16));     \
                for (int b = 0; b < NB; ++b) {                                                                       \
                    const float s = rows[b][kk];                                                                     \
                    /* the next tile's rows (the same thread's, schedule static), a cache line per 16 kk */          \
                    if ((kk & 15) == 0) __builtin_prefetch(rows[b] + NB * k + kk, 0, 1);                              \
                    for (int h = 0; h < VECS; ++h) acc[b][h] += s * xv[h];                                           \
                }                                                                                                    \
            }                                                                                                        \
            for (int b = 0; b < NB; ++b)                                                                             \
                for (int h = 0; h < VECS; ++h) total[b][h] += acc[b][h];                                             \
        }                                                                                                            \
        for (int b = 0; b < nb; ++b) {                                                                               \
            const float add = bias ? bias[j0 + b] : 0.0f;                                                            \
            for (int h = 0; h < VECS; ++h)                                                                           \
                for (int i = 0; i < 16; ++i) {                                                                       \
                    const int64_t row = row0 + 16 * h + i;                                                           \
                    if (row < m) y[row * n + j0 + b] = total[b][h][i] + add;                                         \
                }                                                                                                    \
        }                                                                                                            \
    }

DEFINE_TILE(tile16, 1)
DEFINE_TILE(tile32, 2)

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define DOT_NB 4        /* weight rows per dot tile */
#define DOT_MAX_ROWS 8  /* rows of x taken by dot tiles, four at a time; more rows: the padded tiles */

/* Up to 4 rows (rows = 1..4, a constant at each call site): dot products along k, 16 floats at a time, read
 * straight from x (no packing, no wasted lanes), then one horizontal sum per output and the k % 16 tail. */
ALWAYS_INLINE void dot_tile(const float *restrict x, int64_t x_stride, const float *restrict w,
                            const float *restrict bias, float *restrict y, int rows, int64_t n, int64_t k, int64_t j0,
                            int64_t nb) {
    vec16 acc[DOT_NB][4];
    memset(acc, 0, sizeof acc);
    const float *wrow[DOT_NB];
    for (int b = 0; b < DOT_NB; ++b) wrow[b] = w + (j0 + (b < nb ? b : 0)) * k;
    int64_t kk = 0;
    for (; kk + 16 <= k; kk += 16) {
        vec16 xv[4];
        for (int r = 0; r < rows; ++r) memcpy(&xv[r], x + r * x_stride + kk, sizeof(vec16));
        for (int b = 0; b < DOT_NB; ++b) {
            vec16 wv;
            memcpy(&wv, wrow[b] + kk, sizeof(vec16));
            __builtin_prefetch(wrow[b] + DOT_NB * k + kk, 0, 1); /* the next tile's rows, as above */
            for (int r = 0; r < rows; ++r) acc[b][r] += wv * xv[r];
        }
    }
    for (int b = 0; b < nb; ++b)
        for (int r = 0; r < rows; ++r) {
            float sum = 0.0f;
            for (int i = 0; i < 16; ++i) sum += acc[b][r][i];
            for (int64_t t = kk; t < k; ++t) sum += wrow[b][t] * x[r * x_stride + t];
            y[r * n + j0 + b] = sum + (bias ? bias[j0 + b] : 0.0f);
        }
}

/* Up to DOT_MAX_ROWS rows: each tile of DOT_NB weight rows (in L1 after the first pass) takes the rows of x four at
 * a time. The padded tiles below would compute 16 rows for 5..8 (two to three times the work): on an AMX Xeon this
 * way is 1.5-2.1x faster there (LM head [32000, 512]: 9.4 -> 4.5 ms at 5 rows, 9.5 -> 5.7 ms at 8), and 0.7-0.9x
 * at 16 rows, where the padded tile wastes nothing. */
static void few_rows(const float *restrict x, int64_t x_stride, const float *restrict w, const float *restrict bias,
                     float *restrict y, int64_t m, int64_t n, int64_t k) {
    const int64_t tiles = (n + DOT_NB - 1) / DOT_NB;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t j0 = t * DOT_NB, nb = n - j0 < DOT_NB ? n - j0 : DOT_NB;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const float *xr = x + r0 * x_stride;
            float *yr = y + r0 * n;
            switch (m - r0 < 4 ? m - r0 : 4) {
                case 1: dot_tile(xr, x_stride, w, bias, yr, 1, n, k, j0, nb); break;
                case 2: dot_tile(xr, x_stride, w, bias, yr, 2, n, k, j0, nb); break;
                case 3: dot_tile(xr, x_stride, w, bias, yr, 3, n, k, j0, nb); break;
                case 4: dot_tile(xr, x_stride, w, bias, yr, 4, n, k, j0, nb); break;
            }
        }
    }
}

typedef int32_t ivec16 __attribute__((vector_size(64)));

/* A 16 x 16 transpose in registers: four butterfly stages; at stage s, rows r and r + s (r & s == 0) swap their
 * s-wide pieces, so that afterwards t[j][i] is the input's [i][j]. The masks are literals at each call, so that every
 * shuffle compiles to one two-source permute (GCC's __builtin_shuffle, clang's __builtin_shufflevector). */
#define UNPAREN(...) __VA_ARGS__
#if defined(__clang__)
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, (ivec16){__VA_ARGS__})
#endif
#define BUTTERFLY(s, LO, HI)                                                                                          \
    for (int r = 0; r < 16; ++r)                                                                                      \
        if (!(r & (s))) {                                                                                             \
            const vec16 a = t[r], b = t[r + (s)];                                                                     \
            t[r] = SHUFFLE16(a, b, UNPAREN LO);                                                                       \
            t[r + (s)] = SHUFFLE16(a, b, UNPAREN HI);                                                                 \
        }

static inline void transpose16(vec16 t[16]) {
    BUTTERFLY(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
              (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
    BUTTERFLY(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
              (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
    BUTTERFLY(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
              (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
    BUTTERFLY(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
              (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
}

/* packed[kk * mp + i] = x[i, kk] for the 16 inputs from k0 (k0 + 16 <= k) and all mp rows (zeros past m): 16 x 16
 * pieces read a cache line per row, transposed in registers, stored a line per input. Going down a column of x
 * element by element instead (the earlier code) touches m lines a row apart; rows of 512 floats, 2 KiB apart, map to
 * two of L1's 64 sets: packing 64 x 512 took ~34 us that way (64 x 1376: ~22 us), ~9 us this way. */
static inline void pack_block(const float *restrict x, int64_t x_stride, float *restrict packed, int64_t m, int64_t mp,
                              int64_t k0) {
    for (int64_t i0 = 0; i0 < mp; i0 += 16) {
        vec16 t[16];
        for (int r = 0; r < 16; ++r) {
            if (i0 + r < m)
                memcpy(&t[r], x + (i0 + r) * x_stride + k0, sizeof(vec16));
            else
                t[r] = (vec16){0};
        }
        transpose16(t);
        for (int j = 0; j < 16; ++j) memcpy(packed + (k0 + j) * mp + i0, &t[j], sizeof(vec16));
    }
}

void small_gemm_f32(const float *restrict x, int64_t x_stride, const float *restrict w, const float *restrict bias,
                    float *restrict y, float *restrict packed, int64_t m, int64_t n, int64_t k) {
    if (m <= 0 || n <= 0) return;
    if (m <= DOT_MAX_ROWS) {
        few_rows(x, x_stride, w, bias, y, m, n, k);
        return;
    }
    const int64_t mp = (m + 15) / 16 * 16;
    const int64_t tiles = (n + NB - 1) / NB;
#pragma omp parallel
    {
        const int64_t whole = k / 16 * 16;
#pragma omp for schedule(static) nowait
        for (int64_t k0 = 0; k0 < whole; k0 += 16) pack_block(x, x_stride, packed, m, mp, k0);
#pragma omp for schedule(static)
        for (int64_t kk = whole; kk < k; ++kk) /* the last k % 16 inputs, one by one */
            for (int64_t i = 0; i < mp; ++i) packed[kk * mp + i] = i < m ? x[i * x_stride + kk] : 0.0f;
        /* the implicit barrier of the loop above: every tile sees all of `packed` */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t j0 = t * NB, nb = n - j0 < NB ? n - j0 : NB;
            int64_t row0 = 0;
            for (; mp - row0 >= 32; row0 += 32) tile32(packed, w, bias, y, m, mp, n, k, j0, nb, row0);
            for (; row0 < mp; row0 += 16) tile16(packed, w, bias, y, m, mp, n, k, j0, nb, row0);
        }
    }
}
