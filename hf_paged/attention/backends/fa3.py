"""The `flash3` backend, FlashAttention-3 (Hopper): `flash_attn_with_kvcache` with a page table serves every kind of
step (decodes, chunked prefills, fresh prompts) in one call: packed queries via cu_seqlens_q, each sequence's K/V
read through its row of the page table, any page size, GQA / MQA, sliding window and soft-capping.

Package: `flash_attn_interface` (built from flash-attention's hopper/ folder) or `flash_attn_3`.
"""
from __future__ import annotations

import torch

from ..metadata import AttentionMetadata
from .base import AttentionBackend, StepCache
from .flash_common import as_int32, common_unsupported_reason, cuda_device_reason, import_first, window_left

LIBRARY = "FlashAttention-3"
PACKAGES = ("flash_attn_interface", "flash_attn_3.flash_attn_interface", "flash_attn_3")


def _library():
    for name in PACKAGES:
        module, _ = import_first(name)
        if module is not None and hasattr(module, "flash_attn_with_kvcache"):
            return module, None
    return None, (f"{LIBRARY} is not installed (none of {PACKAGES} provides flash_attn_with_kvcache); "
                  "build it from flash-attention's hopper/ folder")


def fa3_tables(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page_table, cache_seqlens, cu_seqlens_q) as int32: the same for every layer of a step."""
    return as_int32(metadata.block_tables), as_int32(metadata.context_lens), as_int32(metadata.cu_seqlens_q)


def fa3_arguments(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  metadata: AttentionMetadata, scale: float, sliding_window: int | None,
                  softcap: float | None, tables: tuple | None = None) -> dict:
    """Keyword arguments of flash_attn_interface.flash_attn_with_kvcache for one layer of one step.
    q [T, H, D] packed (varlen through cu_seqlens_q); caches [num_blocks, block_size, H_kv, D];
    cache_seqlens = context lengths (this step's tokens included, so causal is bottom-right aligned).
    `tables`: `fa3_tables(metadata)`, passed by a caller that keeps them for the step's other layers."""
    page_table, cache_seqlens, cu_seqlens_q = tables or fa3_tables(metadata)
    return dict(q=query.contiguous(), k_cache=key_cache, v_cache=value_cache, cache_seqlens=cache_seqlens,
                page_table=page_table, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=int(metadata.max_query_len),
                softmax_scale=float(scale), causal=True,
                window_size=(window_left(sliding_window), 0) if sliding_window else (-1, -1),
                softcap=float(softcap or 0.0))


class FlashAttention3Backend(AttentionBackend):
    """`tables`: the int32 tables of the step in progress, built by its first layer."""

    name = "flash3"

    def __init__(self):
        self.library, self.missing = _library()
        self.tables = StepCache()

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        _, reason = _library()
        # FA3's kernels are written for Hopper (sm_90); Ampere / Blackwell use flash2 / flashinfer
        return reason or cuda_device_reason(device, LIBRARY, min_capability=(9, 0), max_major=9)

    def layout_reason(self, query, key_cache, metadata, sliding_window, softcap) -> str | None:
        return common_unsupported_reason(LIBRARY, query, key_cache)

    def forward(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale, sliding_window, softcap,
                key=None, value=None, kv_scales=(1.0, 1.0), extras=None) -> torch.Tensor:
        self.check_extras(extras)
        if self.library is None:
            raise RuntimeError(self.missing)
        tables = self.tables.get(metadata, "tables", lambda: fa3_tables(metadata))
        out = self.library.flash_attn_with_kvcache(**fa3_arguments(query, key_cache, value_cache, metadata, scale,
                                                                   sliding_window, softcap, tables))
        return out[0] if isinstance(out, tuple) else out
