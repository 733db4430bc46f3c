"""An int8 copy of an fp32 LM head for the greedy screen of a few rows (`greedy_head`), and its rounding bound.

At one to a few rows a decode step's LM head is bound by the bytes it reads: the benchmark model's [32000, 512] head
is 65 MB in fp32, 33 MB as the bf16 screen's copy, 16 MB in int8. Here each weight row j is kept as
W_j ~ s_j Q_j (Q_j int8 in [-127, 127], s_j = max_i |W_ji| / 127 in fp32), and the screen of a row x is
S_j = fl(s_j fl(x . Q_j)), with x kept in fp32 (the native pass `greedy_pick_i8` in cpu/greedy_head.c).

The bound. Let L_j be any fp32 evaluation of x . W_j (any order of the sums), u = 2^-24, gamma_k = k u / (1 - k u),
E_j = W_j - s_j Q_j (exact), e_j = ||E_j||. With T_j = fl(x . Q_j) and D_j = x . Q_j exactly:
  |T_j - D_j| <= gamma_k ||x|| ||Q_j||                  (a sum of k products in any order; Q_j exact in fp32)
  |S_j - s_j D_j| <= s_j |T_j - D_j| + u s_j |T_j| <= s_j ||Q_j|| ||x|| (gamma_k + u (1 + gamma_k))
  |s_j D_j - x . W_j| = |x . E_j| <= ||x|| e_j
  |L_j - x . W_j| <= gamma_k ||x|| ||W_j||
so |S_j - L_j| <= ||x|| a_j, a_j = e_j + s_j ||Q_j|| (gamma_k + u (1 + gamma_k)) + gamma_k ||W_j||; the copy keeps
max_j a_j (`error`), computed in float64 and rounded up. Results below the normal range (a CPU flushing them to zero,
inputs or results) move each of the <= 4k + 2 operations by less than 2^-126 times the largest factor involved; the
absolute term k 2^-118 (1 + ||x||) (1 + max |W|) covers them. No overflow: the caller keeps ||x|| max_j ||W_j|| and
||x|| max_j ||Q_j|| below greedy_head.LIMIT (2^100). The row's slack is twice the sum, rounded up.

The bound is the real rounding error, not a worst case of the format: e_j is this copy's own error (for Gaussian
rows ~0.7 % of ||W_j||, against 1.2 % for the bf16 screen's 3 u_bf16 bound), so about as few logits pass the screen.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

U = 2.0 ** -24
ROUND_UP = 1 + 2.0 ** -30  # float64 norms and sums of the bound, rounded up


@dataclass(frozen=True, slots=True)
class Int8Head:
    """The int8 copy of one fp32 weight [n, k]."""
    q: torch.Tensor  # [n, k] int8, contiguous
    scales: torch.Tensor  # [n] fp32
    error: float  # max_j a_j (module docstring)
    q_norm_max: float  # max_j ||Q_j||
    w_norm_max: float  # max_j ||W_j||
    w_abs_max: float  # max |W|

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def quantize(weight: torch.Tensor, rows: int = 4096) -> Int8Head:
    """The int8 copy of an fp32 [n, k] weight with finite entries, a few thousand rows at a time (no float64 copy of
    a whole LM head)."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.float32)
    g = gamma(k)
    error = q_norm_max = w_norm_max = w_abs_max = 0.0
    with torch.no_grad():
        for i in range(0, n, rows):
            w = weight[i:i + rows].detach().float()
            top = w.abs().amax(dim=1)
            s = top / 127
            zero = s == 0
            part = torch.where(zero[:, None], 0.0, w / torch.where(zero, 1.0, s)[:, None])
            part = part.round().clamp(-127, 127)
            q[i:i + rows] = part.to(torch.int8)
            scales[i:i + rows] = s
            w64, s64, q64 = w.double(), s.double(), part.double()
            e = (w64 - s64[:, None] * q64).norm(dim=1)
            q_norm = q64.norm(dim=1)
            w_norm = w64.norm(dim=1)
            a = e + s64 * q_norm * (g + U * (1 + g)) + g * w_norm
            error = max(error, float(a.max()))
            q_norm_max = max(q_norm_max, float(q_norm.max()))
            w_norm_max = max(w_norm_max, float(w_norm.max()))
            w_abs_max = max(w_abs_max, float(top.max()))
    return Int8Head(q, scales, error * ROUND_UP, q_norm_max * ROUND_UP, w_norm_max * ROUND_UP, w_abs_max)


def slack(norms: torch.Tensor, head: Int8Head, k: int) -> torch.Tensor:
    """2 B_r for rows of Euclidean norms `norms` (float64): how far below a row's screen maximum a j may be and still
    hold the row's largest fp32 logit."""
    norms = norms * ROUND_UP
    bound = norms * head.error + k * 2.0 ** -118 * (1 + norms) * (1 + head.w_abs_max)
    return 2 * bound * ROUND_UP
