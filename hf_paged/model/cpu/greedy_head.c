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
        float best = 0.0f;
        int64_t pick = -1, count = 0;
        for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {
            int64_t end = j0 + BLOCK < n ? j0 + BLOCK : n;
            if (end - j0 == BLOCK) {
                int hit = 0;
                for (int64_t i = 0; i < BLOCK; i++)
                    hit |= order_key(row[j0 + i]) >= floor_key;
                if (!hit)
                    continue;
            }
            for (int64_t j = j0; j < end; j++) {
                if (order_key(row[j]) >= floor_key) {
                    float exact = dot(xr, w + j * k, k);
                    count++;
                    if (pick < 0 || exact > best) {
                        best = exact;
                        pick = j;
                    }
                }
            }
        }
        token[r] = pick;
        value[r] = best;
        seen[r] = count;
    }
}
