"""`PagedCache`: a `transformers.Cache` whose layers keep K/V in the pages of a `kv.PagedStore`.

It goes wherever HF takes a cache: `model.generate(..., cache=PagedCache(model.config))`, plain
`model(input_ids, cache=cache, use_cache=True)` loops, beam search (block tables are reordered and blocks shared
by reference count, copied only when a beam writes into a shared block), assisted decoding (`crop` frees the
blocks past the cut). Each layer's `update` writes the new K/V into the pages. When the model runs the
"paged_cache" attention implementation (the generate take-over switches sdpa models to it for the call), the
attention gets a `kv.PagedKV` and decodes read the pages in place; otherwise it gets a gathered,
[batch, heads, length, head_dim] copy of the rows' pages (transient, the same amount of data `DynamicCache`
concatenates every step). The pages are what the cache holds.

Hybrid models (qwen3_5 / qwen3_next, mamba2, nemotron_h, falcon_h1, granitemoehybrid, jamba, bamba, lfm2, zamba2,
olmo_hybrid, ...): their linear-attention / state-space layers ("linear_attention", "conv") are transformers' own
`LinearAttentionLayer` (`StateLayer`: conv and recurrent states, a fixed size per row, so no pages), and a layer
with a state and attention in one ("hybrid", "hybrid_sliding") is a `PagedHybridLayer`; beam reordering, batch
selection, `crop` (rolling states back as transformers does: only after `activate_past_recording`) and the flags
HF reads (`is_linear`, `is_sliding`, `has_previous_state`, ...) treat every layer as `DynamicCache` does. Layer
types it cannot hold (an indexer cache, compressed attention, ...) are refused with a ValueError when it is built.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import (Cache, CacheLayerMixin, DummyLayer, DynamicCache, LinearAttentionCacheLayerMixin,
                                     LinearAttentionLayer, get_layer_types_and_kwargs)

from ..kv import PagedKV, PagedStore
from ..model import CACHE_ATTENTION_NAME

_ATTENTION_LAYERS = {"full_attention": False, "sliding_attention": True, "chunked_attention": True}  # -> is_sliding
_STATE_LAYERS = ("linear_attention", "conv")  # a state only (conv / recurrent): transformers' own layer
_HYBRID_LAYERS = {"hybrid": False, "hybrid_sliding": True}  # a state and attention in one layer -> is_sliding


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of its store: its own length, the store's tables and pages.

    `get_mask_sizes` is the full layer's for every kind: the attention mask applies windows and chunks. A
    sliding-window layer (`sliding_window` set) gives back the blocks its next queries cannot see, as HF's sliding
    layers drop those positions: before writing at `length` it releases the slots before `length - sliding_window + 1`
    (they read as zeros, always under the mask), except while HF records the past for a rollback (`record_past`,
    assisted decoding), when they are kept until the next `crop`. Chunked layers keep every position.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, store: PagedStore, index: int, is_sliding: bool = False, attention_config=None,
                 sliding_window: int | None = None):
        self.store = store
        self.index = index
        self.is_sliding = is_sliding
        self.sliding_window = sliding_window
        self.record_past = False
        self.attention_config = attention_config  # whose `_attn_implementation` says whether attention reads in place
        self.length = 0
        self.is_initialized = False
        self.device = None

    # K/V as HF's layers expose them (read from the pages on demand; assignment is not supported)
    @property
    def keys(self) -> torch.Tensor | None:
        return self.store.read(self.index, self.length)[0] if self.length else None

    @property
    def values(self) -> torch.Tensor | None:
        return self.store.read(self.index, self.length)[1] if self.length else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store K/V ([rows, heads, new, head_dim]) after the layer's current length: `update` without handing
        attention anything."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.sliding_window and not self.record_past:
            self.store.release_before(self.first_visible(self.length))
        self.store.write(self.index, key_states, value_states, self.length)
        self.length += key_states.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.append(key_states, value_states)
        if self.reads_in_place:
            paged = PagedKV(key_states, value_states, self.store, self.index, self.length)
            return paged, paged
        return self.store.read(self.index, self.length)

    @property
    def reads_in_place(self) -> bool:
        """Whether the model's attention is "paged_cache" (it takes a PagedKV and reads the pages itself)."""
        return getattr(self.attention_config, "_attn_implementation", None) == CACHE_ATTENTION_NAME

    def first_visible(self, position: int) -> int:
        """The first slot a query at `position` may read (0 for a layer without a window)."""
        return max(0, position - self.sliding_window + 1) if self.sliding_window else 0

    def activate_past_recording(self, **kwargs) -> None:
        self.record_past = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.store.num_rows

    # batch and length changes are made on the whole cache (the tables are shared): see PagedCache
    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # PagedCache.reorder_cache moves the tables
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass

    def offload(self):
        raise NotImplementedError("PagedCache does not offload layers; size it with num_blocks / kv_cache_memory")

    prefetch = offload


class StateLayer(LinearAttentionLayer):
    """A linear-attention / state-space layer (mamba, gated delta net, short conv): transformers' own
    `LinearAttentionLayer` (conv and recurrent states of a fixed size per row: no pages), with the row selections
    `DynamicCache`'s attention layers have, so that `PagedCache.batch_select_indices` / `batch_repeat_interleave`
    move every layer's rows together (HF's linear layers lack them). States recorded for a rollback move too."""

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda states: states.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda states: states[torch.as_tensor(indices, device=states.device)])

    def _select(self, rows) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = rows(self.conv_states[i])
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = rows(self.recurrent_states[i])
        seen = set()  # transformers may share one history list between a layer's states
        for history in getattr(self, "recurrent_states_history", {}).values():
            if id(history) not in seen:
                seen.add(id(history))
                history[:] = [rows(states) for states in history]


class PagedHybridLayer(StateLayer, PagedLayer):
    """HF's "hybrid" / "hybrid_sliding" layer (falcon_h1, zamba2: a state and attention in one decoder layer): the
    states of a `StateLayer` and the K/V of a `PagedLayer`; its length and mask sizes are the attention's (as in HF's
    `LinearAttentionAndFullAttentionLayer`). Its table moves with the cache's (`PagedCache`), its states here."""

    is_compileable = False

    def __init__(self, store: PagedStore, index: int, is_sliding: bool = False, attention_config=None,
                 sliding_window: int | None = None, number_of_states: int = 1):
        PagedLayer.__init__(self, store, index, is_sliding, attention_config, sliding_window)
        StateLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # attention's `update(keys, values)`
            PagedLayer.lazy_initialization(self, *args)
        else:  # `update_conv_state` / `update_recurrent_state`
            StateLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        return PagedLayer.get_seq_length(self)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return PagedLayer.get_mask_sizes(self, query_length)

    def reset(self) -> None:
        StateLayer.reset(self)
        PagedLayer.reset(self)

    def crop(self, tokens_to_remove: int) -> None:
        StateLayer.crop(self, tokens_to_remove)
        PagedLayer.crop(self, tokens_to_remove)

    offload = prefetch = PagedLayer.offload


class PagedCache(DynamicCache):
    """A transformers `Cache` on paged memory; a `DynamicCache` to code that asks (it grows as generation goes, and
    iterating it yields each layer's K/V as DynamicCache does), with none of DynamicCache's storage.

    `PagedCache(config, block_size=16, num_blocks=None, kv_cache_memory=None)`: with neither size the pool grows as
    needed (doubling); `num_blocks` fixes it (running out raises `MemoryError`); `kv_cache_memory` (bytes) fixes it
    to what fits, counted with the config's K/V shape and its attention layers. `num_bytes_in_use` is the bytes of
    the blocks its tables hold (blocks shared by several rows count once; state layers' tensors are not pages and
    not counted). Without a config, attention layers are added as the model writes them.

    `stores`: one `PagedStore` per kind of layer (full and chunked attention share one; each sliding window has its
    own, whose blocks leave as the window moves on), each with its own tables and `num_blocks` blocks of its layers;
    `store` is the first layer's.
    """

    def __init__(self, config=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None):
        if num_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give PagedCache num_blocks or kv_cache_memory, not both")
        if kv_cache_memory is not None:
            num_blocks = _blocks_in_budget(config, block_size, kv_cache_memory)
        by_window: dict[int | None, PagedStore] = {}

        def store_for(window: int | None) -> PagedStore:
            if window not in by_window:
                by_window[window] = PagedStore(block_size, num_blocks)
            return by_window[window]

        layers = _layers_for(config, store_for) if config is not None else None
        self.stores = list(by_window.values()) or [PagedStore(block_size, num_blocks)]
        self.store = self.stores[0]
        Cache.__init__(self, layers=layers if layers is not None else [], offloading=False)  # not DynamicCache's

    @property
    def num_bytes_in_use(self) -> int:
        return sum(store.num_bytes_in_use for store in self.stores)

    @property
    def block_size(self) -> int:
        return self.store.block_size

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # built without a config: one paged layer per layer written
            self.layers.append(PagedLayer(self.store, len(self.layers)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _paged(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def _states(self) -> list[LinearAttentionCacheLayerMixin]:
        return [layer for layer in self.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` positions (HF's convention: a negative count) and free the blocks
        no row needs any more; sliding-window layers then keep only what their next query sees (as HF's do); state
        layers go back to their recorded states (transformers' own crop). Raises, changing nothing, where the next
        query would need slots a sliding window already gave back, or where a state layer recorded no past."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        for layer in self._states():
            if not layer.record_past:
                raise RuntimeError("cannot crop a PagedCache with linear-attention / state-space layers that do not "
                                   "record their past states: call cache.activate_past_recording() before the "
                                   "forwards you may roll back (HF's generate does for assisted decoding)")
        for layer in self._paged():
            length = max(0, layer.length + tokens_to_remove)
            if layer.sliding_window and layer.first_visible(length) < layer.store.num_released_tokens:
                raise RuntimeError(
                    f"cannot crop the cache to {length} positions: layer {layer.index}'s sliding window "
                    f"({layer.sliding_window}) already gave back positions before "
                    f"{layer.store.num_released_tokens}; call cache.activate_past_recording() before the forwards "
                    "you may roll back (HF's generate does for assisted decoding)")
        for layer in self.layers:
            layer.crop(tokens_to_remove)
        for store in self.stores:
            layers = [layer for layer in self._paged() if layer.store is store]
            length = max((layer.length for layer in layers), default=0)
            store.truncate(length)
            if any(layer.sliding_window for layer in layers):
                store.release_before(min(layer.first_visible(length) for layer in layers))

    # rows move in every store (by table) and in every state layer (its tensors); a store not yet written has none
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        rows = [int(i) for i in beam_idx.reshape(-1).tolist()]
        self._select_rows(lambda num_rows: rows)
        for layer in self._states():
            layer.reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(lambda num_rows: torch.arange(num_rows)[torch.as_tensor(indices).cpu()].reshape(-1).tolist())
        for layer in self._states():
            layer.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(lambda num_rows: [row for row in range(num_rows) for _ in range(repeats)])
        for layer in self._states():
            layer.batch_repeat_interleave(repeats)

    def _select_rows(self, rows_of) -> None:
        for store in self.stores:
            if store.num_rows:
                store.select_rows(rows_of(store.num_rows))

    def reset(self) -> None:
        for store in self.stores:
            store.clear()
        for layer in self.layers:
            layer.reset()


def _layers_for(config, store_for) -> list:
    """The cache layers of `config`'s decoder; `store_for(window)` gives the store of a sliding window's layers
    (None: full and chunked attention)."""
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    layers = []
    for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        window = kwargs.get("sliding_window") if layer_type in ("sliding_attention", "hybrid_sliding") else None
        states = kwargs.get("number_of_states", 1)
        if layer_type == "dummy":
            layers.append(DummyLayer())
        elif layer_type in _ATTENTION_LAYERS:
            layers.append(PagedLayer(store_for(window), index, _ATTENTION_LAYERS[layer_type], text, window))
        elif layer_type in _STATE_LAYERS:
            layers.append(StateLayer(number_of_states=states))
        elif layer_type in _HYBRID_LAYERS:
            layers.append(PagedHybridLayer(store_for(window), index, _HYBRID_LAYERS[layer_type], text, window, states))
        else:
            raise ValueError(f"PagedCache holds attention K/V and linear-attention / state-space states; "
                             f"{getattr(text, 'model_type', 'this model')!r} has layers of type {layer_type!r}")
    return layers


def _blocks_in_budget(config, block_size: int, budget: int) -> int | None:
    """Blocks of every store that `budget` bytes hold, counted over the layers that keep K/V in pages (state layers
    hold a fixed size per row outside the pages; a model without attention needs no blocks: None)."""
    if config is None:
        raise ValueError("kv_cache_memory needs the model config (to know the size of a block)")
    text = config.get_text_config(decoder=True)
    paged = [t for t in get_layer_types_and_kwargs(text)[0] if t in _ATTENTION_LAYERS or t in _HYBRID_LAYERS]
    if not paged:
        return None
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = getattr(text, "dtype", None)
    itemsize = torch.empty((), dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32).element_size()
    per_block = 2 * len(paged) * block_size * heads * head_dim * itemsize
    if budget < per_block:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no block of {per_block} bytes")
    return budget // per_block
