"""The `cuda` backend: hf_paged's own CUDA decode kernel (csrc/, built by attention/cuda_backend.py). Decode-only
steps; every thread block reads its sequence's context length and table row on the device, so a decode step can be
captured in a CUDA graph."""
from __future__ import annotations

import torch

from .. import cuda_backend as extension
from ..metadata import AttentionMetadata
from .base import AttentionBackend


class CudaBackend(AttentionBackend):
    name = "cuda"
    prefill = False
    graph_capturable = True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        return extension.unavailable_reason(device)

    def layout_reason(self, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
                      sliding_window: int | None, softcap: float | None) -> str | None:
        if query.dtype not in extension.DTYPES:
            return f"the CUDA kernel takes float32 / float16 / bfloat16 queries, got {query.dtype}"
        if key_cache.dtype != query.dtype:
            return (f"the CUDA kernel needs the KV cache in the query dtype ({key_cache.dtype} cache, "
                    f"{query.dtype} query)")
        head_dim = query.shape[-1]
        if head_dim not in extension.HEAD_DIMS:
            return f"the CUDA kernel is built for head_dim {extension.HEAD_DIMS}, got {head_dim}"
        if query.shape[1] % key_cache.shape[2]:
            return f"query heads ({query.shape[1]}) must be a multiple of KV heads ({key_cache.shape[2]})"
        if query.stride(-1) != 1 or key_cache.stride(-1) != 1:
            return "the CUDA kernel needs a contiguous head_dim in query and cache"
        return None

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None, softcap: float | None,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                kv_scales: tuple[float, float] = (1.0, 1.0), extras=None) -> torch.Tensor:
        self.check_extras(extras)  # the csrc/ decode kernel has no sink / ALiBi / chunk input: refused, never ignored
        return extension.paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window, softcap)
