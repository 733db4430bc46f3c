"""The cache that `generate(cache_implementation="paged", return_dict_in_generate=True)` returns from an engine run:
a `PagedCache` in HF's layout, so `generate(out.sequences, cache=out.cache, ...)` continues the call.

The engine keeps a row's K/V without its padding; HF's cache has one slot per column of `sequences` but the last.
Each finished row's K/V is copied out of the engine's pages just before they are freed (a scheduler release hook)
and placed at the row's real columns (its prompt's unmasked columns, then its generated ones); padding columns
hold zeros, which the attention mask hides, as HF's own padding slots are. Sliding-window layers keep only what their
next query sees (as after any write to a PagedCache): the engine may have given the rest back already.
State layers (hybrid and state-space models) get each row's state after its computed tokens, copied out of its state
slot at the same moment. A row that ended early (EOS) holds its state at its end: HF's own batch goes on feeding it
padding, which changes HF's state of that row (not its K/V's meaning: the mask hides those columns).
"""
from __future__ import annotations

import torch

from ..kv import KVCache
from ..kv.slots import slot_tensor
from ..kv.state import StateSlots
from .paged_cache import PagedCache, PagedLayer, StateLayer


class KVSnapshots:
    """Per row (`Request.index`), every layer's K and V of its computed tokens, [tokens, heads, head_dim]."""

    def __init__(self, cache: KVCache, states: StateSlots | None = None):
        self.cache = cache
        self.states = states
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self.state_rows: dict[int, dict] = {}  # row -> its state slot's contents {(layer, kind, index): tensor}

    def keep(self, request) -> None:
        """Release hook: copy the request's computed K/V out of its blocks (its block table is still valid)."""
        count, size = request.num_computed_tokens, self.cache.block_size
        positions = torch.arange(count)
        device = self.cache.storage.device
        slots = [slot_tensor(torch.tensor(table, dtype=torch.long), positions, size).to(device)
                 for table in request.block_tables]  # per KV group
        layers = []
        for index, (keys, values) in enumerate(zip(self.cache.key_caches, self.cache.value_caches)):
            if keys is None:  # a state layer: no K/V
                layers.append(None)
                continue
            group = self.cache.layer_group[index]
            k_scale, v_scale = self.cache.kv_scales[index] or (1.0, 1.0)
            k = keys.reshape(-1, *keys.shape[2:])[slots[group]]
            v = values.reshape(-1, *values.shape[2:])[slots[group]]
            if self.cache.quantized:
                k, v = k.float() * k_scale, v.float() * v_scale
            layers.append((k.clone(), v.clone()))
        self.rows[request.index] = layers
        if self.states is not None and request.state_slot >= 0:
            self.state_rows[request.index] = self.states.save(request.state_slot)

    def build(self, model, input_mask: torch.Tensor | None, input_width: int, num_new: list[int],
              width: int, dtype: torch.dtype, block_size: int) -> PagedCache | None:
        """A PagedCache holding `width` columns per row (HF's cache length: `sequences` minus its last column).
        None when a row's K/V was not kept (it never finished normally)."""
        if len(self.rows) != len(num_new) or (self.states is not None and len(self.state_rows) != len(num_new)):
            return None
        cache = PagedCache(model.config, block_size=block_size)
        num_layers = len(next(iter(self.rows.values())))
        for layer in range(num_layers):
            full_k = full_v = None
            if self.rows[0][layer] is None:
                continue
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
        if self.state_rows:
            self._place_states(cache, len(num_new), width, dtype)
        return cache

    def _place_states(self, cache: PagedCache, num_rows: int, width: int, dtype: torch.dtype) -> None:
        """Each state layer gets every row's states, as transformers' own layer holds them after `width` tokens."""
        device = self.cache.storage.device
        for (layer, kind, index) in sorted(self.state_rows[0]):
            target = cache.layers[layer]
            if not isinstance(target, StateLayer):
                raise ValueError(f"layer {layer} of the returned cache holds no state")
            stacked = torch.stack([self.state_rows[row][(layer, kind, index)] for row in range(num_rows)]).to(device)
            if kind == "conv":
                target.lazy_initialization(conv_states=stacked, state_idx=index, conv_kernel_size=stacked.shape[-1])
                target.conv_states[index].copy_(stacked)
            else:
                target.lazy_initialization(recurrent_states=stacked, state_idx=index)
                target.recurrent_states[index].copy_(stacked)
            target.has_previous_state[index] = True
            target.cumulative_length_linear.fill_(width)


def _real_columns(mask: torch.Tensor | None, row: int, input_width: int, num_new: int) -> torch.Tensor:
    prompt = torch.arange(input_width) if mask is None else (mask[row].cpu() != 0).nonzero().reshape(-1)
    return torch.cat([prompt, input_width + torch.arange(num_new)])
