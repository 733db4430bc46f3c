"""What a layer's attention may add to plain causal softmax attention (`LayerExtras`), and the dense reference pieces
every backend must agree with: the mask (`allowed`), the ALiBi bias (`alibi_bias`) and the learned relative-position
bias (`relative_bias`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

EXTRA_NAMES = ("sinks", "alibi", "chunked", "relative")


@dataclass(slots=True, eq=False)
class LayerExtras:
    """Per-layer additions, all optional. With q the query's and k the key's position in its sequence (0-based):

    - `sinks` [H]: a per-head logit that joins every row's softmax denominator and contributes no value (gpt-oss,
      granite_swa); it is added after scaling / soft-capping of the real scores, never scaled itself.
    - `alibi_slopes` [H] (float32): score += slope * (k - q) (ALiBi: bloom, mpt), after scaling and soft-capping.
      Softmax is shift-invariant per row, so any per-row offset of the bias (HF's `slope * k`) is the same attention.
    - `chunk_size` C: a query attends only to keys of its own chunk, k // C == q // C (llama4's chunked layers);
      combined with causality and any sliding window.
    - `relative_logits` [T, E] per head, i.e. [T, H, E], one row per packed query row of the call: score +=
      relative_logits[row, h, q - k] for 0 <= q - k < E, nothing for keys E or more positions back (inkling: a bias
      by backward distance that each query mixes from a learned bank), after scaling and soft-capping.

    Invariant: an all-None LayerExtras is plain attention (`any()` is False), so callers may pass None instead.
    """

    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    chunk_size: int | None = None
    relative_logits: torch.Tensor | None = None

    def any(self) -> bool:
        return bool(self.names())

    def names(self) -> frozenset[str]:
        """Which of EXTRA_NAMES this layer uses (what a backend must support to serve it)."""
        used = {"sinks": self.sinks is not None, "alibi": self.alibi_slopes is not None,
                "chunked": bool(self.chunk_size), "relative": self.relative_logits is not None}
        return frozenset(name for name, on in used.items() if on)


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None,
            chunk_size: int | None) -> torch.Tensor:
    """Bool mask (broadcast of q_pos[..., None] against k_pos): causal, within the window, within the chunk."""
    q, k = q_pos[..., None], k_pos
    mask = k <= q
    if sliding_window:
        mask &= k > q - sliding_window
    if chunk_size:
        mask &= k >= torch.div(q, chunk_size, rounding_mode="floor") * chunk_size
    return mask


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """slopes [H], q_pos [..., Q], k_pos [L] -> bias [..., H, Q, L] = slope * (k - q) in float32."""
    offset = (k_pos[None, :] - q_pos[..., :, None]).float()  # [..., Q, L]
    return slopes.float().view(-1, 1, 1) * offset.unsqueeze(-3)


def relative_bias(rows: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """rows [..., Q, H, E] (each query's `relative_logits`), q_pos [..., Q], k_pos [L] -> bias [..., H, Q, L] in
    float32: rows[q, h, q - k] where 0 <= q - k < E, else 0."""
    distance = q_pos[..., :, None] - k_pos  # [..., Q, L]
    extent = rows.shape[-1]
    per_head = rows.float().transpose(-3, -2)  # [..., H, Q, E]
    index = distance.clamp(0, extent - 1).unsqueeze(-3).expand(*per_head.shape[:-1], distance.shape[-1])
    outside = ((distance < 0) | (distance >= extent)).unsqueeze(-3)
    return per_head.gather(-1, index).masked_fill(outside, 0.0)
