"""The `flash2` backend, FlashAttention-2: `flash_attn_varlen_func` with `block_table` serves every kind of step in one
call (packed queries via cu_seqlens_q, per-sequence context lengths via cu_seqlens_k, K/V read through the block
table).

FA2's paged path only takes pages whose size is a multiple of 256 tokens (its K/V tile loop walks whole 256-token
pages), so this backend needs `block_size=256` (or 512, ...); with the default 16 it reports itself unsupported and
"auto" moves on. Package: `flash-attn` >= 2.6 (soft-capping arrived in 2.6).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from ..metadata import AttentionMetadata
from .base import AttentionBackend, StepCache
from .flash_common import as_int32, common_unsupported_reason, cuda_device_reason, import_first, window_left

LIBRARY = "FlashAttention-2"
PAGE_MULTIPLE = 256
MIN_VERSION = (2, 6)


def _version(module) -> tuple[int, ...]:
    """(major, minor) of the module's __version__: the leading digits of each of its first two pieces ("2.6+cu121"
    is (2, 6), "2.5rc1" (2, 5), not the digits run together)."""
    parts = []
    for piece in str(getattr(module, "__version__", "0")).split(".")[:2]:
        digits = re.match(r"\d*", piece).group()
        parts.append(int(digits or 0))
    return tuple(parts)


def _library():
    module, error = import_first("flash_attn")
    if module is None:
        return None, f"{LIBRARY} is not installed ({error}); pip install flash-attn"
    if not hasattr(module, "flash_attn_varlen_func"):
        return None, f"this flash_attn has no flash_attn_varlen_func (version {getattr(module, '__version__', '?')})"
    if _version(module) < MIN_VERSION:
        return None, (f"flash_attn {module.__version__} is too old: the paged path with soft-capping needs >= "
                      f"{'.'.join(map(str, MIN_VERSION))}")
    return module, None


def fa2_tables(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_table, cu_seqlens_q, cu_seqlens_k) as int32: the same for every layer of a step."""
    context_lens = metadata.context_lens.to(torch.int32)
    cu_seqlens_k = F.pad(torch.cumsum(context_lens, 0, dtype=torch.int32), (1, 0))
    return as_int32(metadata.block_tables), as_int32(metadata.cu_seqlens_q), cu_seqlens_k.contiguous()


def fa2_arguments(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  metadata: AttentionMetadata, scale: float, sliding_window: int | None,
                  softcap: float | None, tables: tuple | None = None) -> dict:
    """Keyword arguments of flash_attn.flash_attn_varlen_func for one layer of one step. With a block_table the
    k / v arguments are the page pools [num_blocks, block_size, H_kv, D] and cu_seqlens_k (int32 [B + 1]) the
    cumulative context lengths, which place each sequence's queries at the bottom-right of its causal mask.
    `tables`: `fa2_tables(metadata)`, passed by a caller that keeps them for the step's other layers."""
    block_table, cu_seqlens_q, cu_seqlens_k = tables or fa2_tables(metadata)
    return dict(q=query.contiguous(), k=key_cache, v=value_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=int(metadata.max_query_len), max_seqlen_k=int(metadata.max_context_len),
                softmax_scale=float(scale), causal=True,
                window_size=(window_left(sliding_window), 0) if sliding_window else (-1, -1),
                softcap=float(softcap or 0.0), block_table=block_table)


class FlashAttention2Backend(AttentionBackend):
    """`tables`: the int32 tables of the step in progress, built by its first layer."""

    name = "flash2"

    def __init__(self):
        self.library, self.missing = _library()
        self.tables = StepCache()

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        _, reason = _library()
        return reason or cuda_device_reason(device, LIBRARY, min_capability=(8, 0))

    def layout_reason(self, query, key_cache, metadata, sliding_window, softcap) -> str | None:
        block_size = key_cache.shape[1]
        if block_size % PAGE_MULTIPLE:
            return (f"{LIBRARY} reads paged KV only with page sizes that are multiples of {PAGE_MULTIPLE} "
                    f"(block_size={block_size}); use block_size=256, or the flash3 / flashinfer / cuda backends")
        return common_unsupported_reason(LIBRARY, query, key_cache)

    def forward(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale, sliding_window, softcap,
                key=None, value=None, kv_scales=(1.0, 1.0), extras=None) -> torch.Tensor:
        self.check_extras(extras)
        if self.library is None:
            raise RuntimeError(self.missing)
        tables = self.tables.get(metadata, "tables", lambda: fa2_tables(metadata))
        out = self.library.flash_attn_varlen_func(**fa2_arguments(query, key_cache, value_cache, metadata, scale,
                                                                  sliding_window, softcap, tables))
        return out[0] if isinstance(out, tuple) else out
