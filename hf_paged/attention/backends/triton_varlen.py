"""The `triton` backend: one varlen Triton kernel for every kind of step (attention/triton_backend.py launches it,
attention/triton_kernels.py defines it). Reads scaled fp8 caches; decode steps can be captured in CUDA graphs
(grid and split count come from shapes and the pinned max_context_len only)."""
from __future__ import annotations

import os

import torch

from .. import triton_backend as launcher
from ..extras import EXTRA_NAMES, LayerExtras
from ..metadata import AttentionMetadata
from .base import AttentionBackend


class TritonBackend(AttentionBackend):
    name = "triton"
    fp8 = True
    graph_capturable = True
    extras = frozenset(EXTRA_NAMES) - {"relative"}  # no learned relative-position bias in the kernel

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if launcher.IMPORT_ERROR is not None:
            return launcher.IMPORT_ERROR
        if torch.device(device).type == "cuda":
            if launcher.interpreted():
                return "triton kernels were defined in interpreter mode (TRITON_INTERPRET=1)"
            return None
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "triton needs a CUDA device (or TRITON_INTERPRET=1)"
        if not launcher.interpreted():
            return "TRITON_INTERPRET=1 was set after the triton kernels were defined (set it before importing hf_paged)"
        return None

    def layout_reason(self, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
                      sliding_window: int | None, softcap: float | None) -> str | None:
        if query.dtype not in launcher.DTYPES:
            return f"triton backend supports float16 / bfloat16 / float32, not {query.dtype}"
        if key_cache.dtype not in (query.dtype, launcher.FP8):
            return (f"triton backend needs the cache dtype ({key_cache.dtype}) to match the queries ({query.dtype}) "
                    "or to be torch.float8_e4m3fn")
        block_size = key_cache.shape[1]
        if block_size < 8 or block_size & (block_size - 1):
            return f"triton backend needs a power-of-two block size >= 8, not {block_size}"
        head_dim = query.shape[-1]
        if not launcher.MIN_HEAD_DIM <= head_dim <= launcher.MAX_HEAD_DIM or head_dim % 8:
            return (f"triton backend supports head dims {launcher.MIN_HEAD_DIM}..{launcher.MAX_HEAD_DIM} in steps "
                    f"of 8, not {head_dim}")
        heads, kv_heads = query.shape[1], key_cache.shape[2]
        if heads % kv_heads or heads // kv_heads > launcher.MAX_HEADS_PER_KV:
            return (f"triton backend needs query heads ({heads}) a multiple of KV heads ({kv_heads}), at most "
                    f"{launcher.MAX_HEADS_PER_KV} per KV head")
        if query.stride(-1) != 1 or key_cache.stride(-1) != 1:
            return "triton backend needs the head dim contiguous in queries and caches"
        if key_cache.device != query.device:
            return "triton backend needs queries and caches on one device"
        return None

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None, softcap: float | None,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                kv_scales: tuple[float, float] = (1.0, 1.0), extras: LayerExtras | None = None) -> torch.Tensor:
        return launcher.paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window, softcap,
                                        kv_scales=kv_scales, extras=extras)
