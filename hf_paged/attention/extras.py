"""What a layer's attention may add to plain causal softmax attention (`LayerExtras`), and the dense reference pieces
every backend must agree with: the mask (`allowed`) and the ALiBi bias (`alibi_bias`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

EXTRA_NAMES = ("sinks", "alibi", "chunked")


@dataclass(slots=True, eq=False)
class LayerExtras:
    """Per-layer additions, all optional. With q the query's and k the key's position in its sequence (0-based):

    - `sinks` [H]: a per-head logit that joins every row's softmax denominator and contributes no value (gpt-oss,
      granite_swa); it is added after scaling / soft-capping of the real scores, never scaled itself.
    - `alibi_slopes` [H] (float32): score += slope * (k - q) (ALiBi: bloom, mpt), after scaling and soft-capping.
      Softmax is shift-invariant per row, so any per-row offset of the bias (HF's `slope * k`) is the same attention.
    - `chunk_size` C: a query attends only to keys of its own chunk, k // C == q // C (llama4's chunked layers);
      combined with causality and any sliding window.

    Invariant: an all-None LayerExtras is plain attention (`any()` is False), so callers may pass None instead.
    """

    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    chunk_size: int | None = None

    def any(self) -> bool:
        return self.sinks is not None or self.alibi_slopes is not None or bool(self.chunk_size)

    def names(self) -> frozenset[str]:
        """Which of EXTRA_NAMES this layer uses (what a backend must support to serve it)."""
        used = {"sinks": self.sinks is not None, "alibi": self.alibi_slopes is not None,
                "chunked": bool(self.chunk_size)}
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
