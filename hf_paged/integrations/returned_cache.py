"""The cache that `generate(cache_implementation="paged", return_dict_in_generate=True)` returns from an engine run:
a `PagedCache` in HF's layout, so `generate(out.sequences, cache=out.cache, ...)` continues the call.

The engine keeps a row's K/V without its padding; HF's cache has one slot per column of `sequences` but the last.
Each finished row's K/V is copied out of the engine's pages just before they are freed (a scheduler release hook)
and placed at the row's real columns (its prompt's unmasked columns, then its generated ones); padding columns
hold zeros, which the attention mask hides, as HF's own padding slots are. Sliding-window layers keep only what their
next query sees (as after any write to a PagedCache): the engine may have given the rest back already.
"""
from __future__ import annotations

import torch

from ..kv import KVCache
from .paged_cache import PagedCache, PagedLayer


class KVSnapshots:
    """Per row (`Request.index`), every layer's K and V of its computed tokens, [tokens, heads, head_dim]."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def keep(self, request) -> None:
        """Release hook: copy the request's computed K/V out of its blocks (its block table is still valid)."""
        count, size = request.num_computed_tokens, self.cache.block_size
        positions = torch.arange(count)
        table = torch.tensor(request.block_table, dtype=torch.long)
        slots = (table[positions // size] * size + positions % size).to(self.cache.storage.device)
        layers = []
        for index, (keys, values) in enumerate(zip(self.cache.key_caches, self.cache.value_caches)):
            k_scale, v_scale = self.cache.kv_scales[index] or (1.0, 1.0)
            k = keys.reshape(-1, *keys.shape[2:])[slots]
            v = values.reshape(-1, *values.shape[2:])[slots]
            if self.cache.quantized:
                k, v = k.float() * k_scale, v.float() * v_scale
            layers.append((k.clone(), v.clone()))
        self.rows[request.index] = layers

    def build(self, model, input_mask: torch.Tensor | None, input_width: int, num_new: list[int],
              width: int, dtype: torch.dtype, block_size: int) -> PagedCache | None:
        """A PagedCache holding `width` columns per row (HF's cache length: `sequences` minus its last column).
        None when a row's K/V was not kept (it never finished normally)."""
        if len(self.rows) != len(num_new):
            return None
        cache = PagedCache(model.config, block_size=block_size)
        num_layers = len(next(iter(self.rows.values())))
        for layer in range(num_layers):
            full_k = full_v = None
            for row in range(len(num_new)):
                k, v = self.rows[row][layer]
                if full_k is None:
                    full_k = k.new_zeros(len(num_new), width, *k.shape[1:], dtype=dtype)
                    full_v = v.new_zeros(len(num_new), width, *v.shape[1:], dtype=dtype)
                columns = _real_columns(input_mask, row, input_width, num_new[row])[: k.shape[0]]
                keep = (columns < width).nonzero().reshape(-1)
                full_k[row, columns[keep].to(k.device)] = k[keep.to(k.device)].to(dtype)
                full_v[row, columns[keep].to(v.device)] = v[keep.to(v.device)].to(dtype)
            if layer < len(cache.layers) and isinstance(cache.layers[layer], PagedLayer):
                cache.layers[layer].append(full_k.transpose(1, 2), full_v.transpose(1, 2))
        for paged in cache.layers:  # what a window left behind is gone (the engine may have released it: zeros)
            if isinstance(paged, PagedLayer) and paged.sliding_window:
                paged.store.release_before(paged.first_visible(width))
        return cache


def _real_columns(mask: torch.Tensor | None, row: int, input_width: int, num_new: int) -> torch.Tensor:
    prompt = torch.arange(input_width) if mask is None else (mask[row].cpu() != 0).nonzero().reshape(-1)
    return torch.cat([prompt, input_width + torch.arange(num_new)])
