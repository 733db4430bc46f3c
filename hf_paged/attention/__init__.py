"""Paged attention: metadata, backend objects and the chooser behind one functional entry point. Knows nothing
about scheduling."""
from __future__ import annotations

import torch

from ..kv.slots import slots_of
from .backends import AttentionBackend
from .cpu_kernel import cpu_kernel_status
from .extras import LayerExtras
from .dispatch import BACKENDS, AttentionBackends, choose_backends, unavailable, why_not
from .metadata import AttentionMetadata, DenseTile
from .torch_backend import store_kv


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor | None = None, context_lens: torch.Tensor | None = None,
                    block_tables: torch.Tensor | None = None, *, scale: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None, backend: str = "auto",
                    metadata: AttentionMetadata | None = None, key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None, kv_scales: tuple[float, float] = (1.0, 1.0),
                    strict: bool = True, sinks: torch.Tensor | None = None,
                    extras: LayerExtras | None = None) -> torch.Tensor:
    """Causal attention of packed queries [T, H, D] over paged caches [num_blocks, block_size, H_kv, D].

    Either pass a prebuilt `metadata` (the engine does, once per step) or the raw varlen tensors.
    Queries are aligned bottom-right: the last query row of sequence b sits at position context_lens[b] - 1.
    `backend`: one of BACKENDS. "torch" is plain torch; "auto" picks the best available for the device, shape
    and block size (on CPU: torch plus the native decode kernel); asking for one that cannot run is an error.
    `key` / `value` (the new tokens' K/V, [T, H_kv, D], already stored) let the torch backend skip re-reading pages.
    `kv_scales`: (k_scale, v_scale) of an fp8 cache (stored = value / scale).
    `strict=False`: a named backend that does not cover this particular call gives way to "auto".
    `sinks`: per-head attention-sink logits [H] that join each row's softmax denominator; `extras`: the layer's
    sinks / ALiBi slopes / attention chunk (LayerExtras; a backend that does not implement them gives way to torch).
    Each call chooses afresh; a caller making many calls keeps one `choose_backends(...)` and calls its `attend`.
    """
    backends = choose_backends(backend, query.device, strict=strict)
    if metadata is None:
        if cu_seqlens_q is None or context_lens is None or block_tables is None:
            raise ValueError("paged_attention needs either metadata or cu_seqlens_q, context_lens and block_tables")
        metadata = _metadata_of(cu_seqlens_q, context_lens, block_tables, key_cache.shape[1], query.device)
    return backends.attend(query, key_cache, value_cache, metadata, scale, sliding_window, softcap, key, value,
                           kv_scales, sinks=sinks, extras=extras)


def _metadata_of(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                 block_size: int, device: torch.device) -> AttentionMetadata:
    """The metadata of raw varlen tensors (slots: where each sequence's last query_len positions live)."""
    cu = cu_seqlens_q.tolist()
    query_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    tables = block_tables.tolist()
    contexts = context_lens.tolist()
    slots = [s for table, q, c in zip(tables, query_lens, contexts) for s in slots_of(table, c - q, c, block_size)]
    return AttentionMetadata.build(query_lens, contexts, tables, slots, block_size, device)


__all__ = ["AttentionMetadata", "LayerExtras", "DenseTile", "paged_attention", "store_kv", "BACKENDS", "cpu_kernel_status",
           "why_not", "unavailable", "AttentionBackend", "AttentionBackends", "choose_backends"]
