"""The `torch` backend: plain torch (SDPA over dense groups, attention/torch_backend.py) on any device and dtype,
plus, when "auto" chooses it, the native CPU decode kernel (attention/cpu_kernel.py) for fp32 and bf16 decodes."""
from __future__ import annotations

import torch

from ..extras import EXTRA_NAMES, LayerExtras
from ..metadata import AttentionMetadata
from ..torch_backend import torch_paged_attention
from .base import AttentionBackend


class TorchBackend(AttentionBackend):
    """Serves every call. `native_decode`: fp32 and bf16 decodes on CPU run the native kernel where it could be built
    ("auto" turns it on; the explicitly named "torch" backend stays plain torch, the reference)."""

    name = "torch"
    fp8 = True
    extras = frozenset(EXTRA_NAMES)
    strided_pages = True

    def __init__(self, native_decode: bool = False):
        self.native_decode = native_decode

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None, softcap: float | None,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                kv_scales: tuple[float, float] = (1.0, 1.0), extras: LayerExtras | None = None) -> torch.Tensor:
        return torch_paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window, softcap, key,
                                     value, native_decode=self.native_decode, kv_scales=kv_scales, extras=extras)
