/* The greedy pick of an fp32 LM head from a bf16 screen: for each row r, the first j with the largest fp32 logit
 * x[r] . w[j], computing fp32 logits only for the j the screen cannot rule out.
 *
 * screen: [m, n] bf16 (as uint16) approximate logits, row r at screen + r * n (from a bf16 copy of w)
 * x:      [m, k] fp32 rows `x_stride` floats apart, each row contiguous (the LM head's input)
 * w:      [n, k] fp32 contiguous (the LM head's own weight)
 * slack:  [m] double, slack[r] >= 2 * (the largest possible |screen[r, j] - fp32 logit[r, j]| over j): the caller's
 *         rigorous bound (model/greedy_head.py)
 * token:  [m] out: the pick
 * value:  [m] out: its fp32 logit
 * seen:   [m] out: how many exact logits the row needed
 *
 * Why exact: with B >= |screen_j - L_j| for every j (L the fp32 logits, any summation order), the fp32 argmax j*
 * satisfies screen_j* + B >= L_j* >= L_i >= screen_i - B for the i holding the screen's maximum, so
 * screen_j* >= max(screen) - 2B = max(screen) - slack: every j that could hold the maximum passes the threshold, and
 * among those the exact logits decide, ties to the first j (j ascends, a later j must be strictly greater). The
 * threshold is taken in double and rounded down to a float, so no rounding of it can exclude a j. The caller guarantees finite inputs.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define BLOCK 64 /* screen entries tested at once in the second pass */

/* A key whose unsigned order is the numeric order of finite bf16 values (-0 just below +0). */
static inline uint16_t order_key(uint16_t bits) {
    return bits & 0x8000 ? (uint16_t)~bits : (uint16_t)(bits | 0x8000);
}

static inline float key_value(uint16_t key) {
    uint32_t u = (uint32_t)(key & 0x8000 ? key & 0x7fff : (uint16_t)~key) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The key of the largest bf16 value <= t (t finite; +0 and -0 both give -0's key, so both zeros pass). */
static inline uint16_t key_at_or_below(double t) {
    float f = (float)t;
    if ((double)f > t)
        f = nextafterf(f, -INFINITY);
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t bits = (uint16_t)(u >> 16);
    if ((u & 0x8000ffffu) > 0x80000000u)  /* negative with bits cut off: one bf16 step more negative */
        bits++;
    if ((bits & 0x7fff) == 0)
        bits = 0x8000;
    return order_key(bits);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t k) {
    float total = 0.0f;
    for (int64_t i = 0; i < k; i++)
        total += a[i] * b[i];
    return total;
}

/* A row's pick so far: the first j with the largest exact logit among those computed (`consider`, j ascending). */
typedef struct {
    float best;
    int64_t pick, count;
} Pick;

static inline void take(Pick *p, float exact, int64_t j) {
    p->count++;
    if (p->pick < 0 || exact > p->best) {
        p->best = exact;
        p->pick = j;
    }
}

static inline void consider(Pick *p, const float *restrict xr, const float *restrict w, int64_t j, int64_t k) {
    take(p, dot(xr, w + j * k, k), j);
}

static inline void store(Pick p, int64_t r, int64_t *token, float *value, int64_t *seen) {
    token[r] = p.pick;
    value[r] = p.best;
    seen[r] = p.count;
}

void greedy_pick(const uint16_t *screen, const float *x, int64_t x_stride, const float *w, const double *slack,
                 int64_t *token, float *value, int64_t *seen, int64_t m, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = screen + r * n;
        uint16_t top = 0;
        for (int64_t j = 0; j < n; j++) {
            uint16_t key = order_key(row[j]);
            top = key > top ? key : top;
        }
        const uint16_t floor_key = key_at_or_below((double)key_value(top) - slack[r]);
        const float *xr = x + r * x_stride;
        Pick p = {0.0f, -1, 0};
        for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {
            int64_t end = j0 + BLOCK < n ? j0 + BLOCK : n;
            if (end - j0 == BLOCK) {
                int hit = 0;
                for (int64_t i = 0; i < BLOCK; i++)
                    hit |= order_key(row[j0 + i]) >= floor_key;
                if (!hit)
                    continue;
            }
            for (int64_t j = j0; j < end; j++)
                if (order_key(row[j]) >= floor_key)
                    consider(&p, xr, w, j, k);
        }
        store(p, r, token, value, seen);
    }
}

/* The same pick from an int8 copy of w, for a few rows (model/int8_head.py): q [n, k] int8 and scale [n] fp32 with
 * w[j] ~ scale[j] * q[j]. The screen keeps x in fp32: screen[r, j] = scale[j] * (x[r] . q[j]), the dot in fp32 (any
 * order: the caller's bound covers every order), into `screen` [m, n] fp32 (scratch, also handed back). slack[r] is
 * again >= 2 * the largest |screen[r, j] - fp32 logit[r, j]|, so the argument above holds with fp32 screen values.
 * Reading q (a quarter of w's bytes) is what a one-row step pays for: tiles of I8_ROWS weight rows, each converted to
 * fp32 once per 16 inputs and multiplied against up to 4 rows of x held in registers; tiles are spread over threads.
 * The hardware prefetchers alone left the pass at ~6 GB/s from memory (2.7 ms for the benchmark model's 16 MB at one
 * row, one thread, AMX Xeon VM); prefetching each row I8_AHEAD rows ahead into L2 brought it to 1.5-1.8 ms (32-256
 * rows ahead of a 512-input head measured alike). */
#define I8_ROWS 4
#define I8_AHEAD 64

#ifdef __AVX512F__
typedef __m512 vf;
#define VW 16
static inline vf q_load(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf x_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline float v_sum(vf v) { return _mm512_reduce_add_ps(v); }
#else /* portable: vectors as wide as the target's (8 floats with AVX, else 4), whatever the compiler makes of them */
#ifdef __AVX__
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(4 * VW), aligned(4)));
static inline vf q_load(const int8_t *p) { vf v; for (int i = 0; i < VW; i++) v[i] = (float)p[i]; return v; }
static inline vf x_load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf v_zero(void) { vf v = {0}; return v; }
static inline float v_sum(vf v) { float t = 0.0f; for (int i = 0; i < VW; i++) t += v[i]; return t; }
#endif

/* screen[r, j0 + b] for rows r0 .. r0 + RB - 1 and b < I8_ROWS */
#define DEFINE_I8_TILE(NAME, RB)                                                                                   \
    static inline void NAME(const int8_t *restrict q, const float *restrict scale, const float *restrict x,       \
                            int64_t xs, float *restrict screen, int64_t n, int64_t k, int64_t j0, int64_t r0) {   \
        vf acc[RB][I8_ROWS];                                                                                       \
        for (int r = 0; r < RB; ++r)                                                                               \
            for (int b = 0; b < I8_ROWS; ++b) acc[r][b] = v_zero();                                                \
        const int8_t *rows = q + j0 * k;                                                                           \
        const int8_t *ahead = rows + I8_AHEAD * k;                                                                 \
        const int64_t kv = k - k % VW;                                                                             \
        for (int64_t kk = 0; kk < kv; kk += VW) {                                                                  \
            if ((kk & 63) < VW) /* a cache line of each row of the tile I8_AHEAD rows on, into L2 */              \
                for (int b = 0; b < I8_ROWS; ++b) __builtin_prefetch(ahead + b * k + kk, 0, 1);                  \
            vf wv[I8_ROWS];                                                                                        \
            for (int b = 0; b < I8_ROWS; ++b) wv[b] = q_load(rows + b * k + kk);                                   \
            for (int r = 0; r < RB; ++r) {                                                                         \
                const vf xv = x_load(x + (r0 + r) * xs + kk);                                                      \
                for (int b = 0; b < I8_ROWS; ++b) acc[r][b] = v_fma(xv, wv[b], acc[r][b]);                         \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < RB; ++r)                                                                               \
            for (int b = 0; b < I8_ROWS; ++b) {                                                                    \
                float total = v_sum(acc[r][b]);                                                                    \
                for (int64_t kk = kv; kk < k; ++kk) total += x[(r0 + r) * xs + kk] * (float)rows[b * k + kk];    \
                screen[(r0 + r) * n + j0 + b] = scale[j0 + b] * total;                                             \
            }                                                                                                      \
    }
DEFINE_I8_TILE(i8_tile1, 1)
DEFINE_I8_TILE(i8_tile2, 2)
DEFINE_I8_TILE(i8_tile3, 3)
DEFINE_I8_TILE(i8_tile4, 4)

void screen_i8(const int8_t *q, const float *scale, const float *x, int64_t x_stride, float *screen,
               int64_t m, int64_t n, int64_t k) {
    const int64_t tiles = n / I8_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t j0 = t * I8_ROWS;
        int64_t r0 = 0;
        for (; r0 + 4 <= m; r0 += 4) i8_tile4(q, scale, x, x_stride, screen, n, k, j0, r0);
        switch (m - r0) {
            case 3: i8_tile3(q, scale, x, x_stride, screen, n, k, j0, r0); break;
            case 2: i8_tile2(q, scale, x, x_stride, screen, n, k, j0, r0); break;
            case 1: i8_tile1(q, scale, x, x_stride, screen, n, k, j0, r0); break;
            default: break;
        }
    }
    for (int64_t j = tiles * I8_ROWS; j < n; j++) /* the last n % I8_ROWS weight rows */
        for (int64_t r = 0; r < m; r++) {
            float total = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) total += x[r * x_stride + kk] * (float)q[j * k + kk];
            screen[r * n + j] = scale[j] * total;
        }
}

/* The largest float <= t (t finite). */
static inline float float_at_or_below(double t) {
    float f = (float)t;
    return (double)f > t ? nextafterf(f, -INFINITY) : f;
}

/* A bf16 head's logit as its usual product gives it: the fp32 sum of x[i] * w[i] (every product exact in fp32),
 * rounded to bf16 (to nearest, ties to even; finite values). */
static inline float bf16_logit(const float *restrict xr, const uint16_t *restrict w, int64_t k) {
    float total = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const uint32_t bits = (uint32_t)w[i] << 16;
        float wi;
        memcpy(&wi, &bits, sizeof wi);
        total += xr[i] * wi;
    }
    uint32_t u;
    memcpy(&u, &total, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&total, &u, sizeof total);
    return total;
}

/* w: the fp32 head, or NULL for a bf16 head `w_bf16` [n, k] (then x holds its rows converted to fp32). A bf16 head's
 * logits are rounded to bf16, so several may tie for a row's maximum M = bf16(L*), L* the largest fp32 sum: a j with
 * bf16(L_j) = M has L_j >= M - u |L_j| and M >= L* - u |L*| (u = 2^-8), and |L_j|, |L*| <= (|top| + B)(1 + 2u) with
 * top the screen's maximum, so the floor drops a further `rel` (|top| + slack / 2), rel >= 2u (1 + 2u)^2 (the
 * caller's); the first j with the largest bf16 value is the pick, as `first_argmax` of the bf16 logits. */
void greedy_pick_i8(const int8_t *q, const float *scale, const float *x, int64_t x_stride, const float *w,
                    const uint16_t *w_bf16, const double *slack, double rel, float *screen, int64_t *token,
                    float *value, int64_t *seen, int64_t m, int64_t n, int64_t k) {
    screen_i8(q, scale, x, x_stride, screen, m, n, k);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const float *row = screen + r * n;
        float top = row[0];
        for (int64_t j = 1; j < n; j++)
            top = row[j] > top ? row[j] : top;
        const float floor_value = float_at_or_below((double)top - slack[r] - rel * (fabs((double)top) + slack[r] / 2));
        const float *xr = x + r * x_stride;
        Pick p = {0.0f, -1, 0};
        for (int64_t j = 0; j < n; j++) {
            if (row[j] < floor_value)
                continue;
            if (w != NULL)
                consider(&p, xr, w, j, k);
            else
                take(&p, bf16_logit(xr, w_bf16 + j * k, k), j);
        }
        store(p, r, token, value, seen);
    }
}
