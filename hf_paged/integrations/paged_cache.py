"""`PagedCache`: a `transformers.Cache` whose layers keep K/V in the pages of a `kv.PagedStore`.

It goes wherever HF takes a cache: `model.generate(..., cache=PagedCache(model.config))`, plain
`model(input_ids, cache=cache, use_cache=True)` loops, beam search (block tables are reordered and blocks shared
by reference count, copied only when a beam writes into a shared block), assisted decoding (`crop` frees the
blocks past the cut). Each layer's `update` writes the new K/V into the pages. When the model runs the
"paged_cache" attention implementation (the generate take-over switches sdpa models to it for the call), the
attention gets a `kv.PagedKV` and decodes read the pages in place; otherwise it gets a gathered,
[batch, heads, length, head_dim] copy of the rows' pages (transient, the same amount of data `DynamicCache`
concatenates every step). The pages are what the cache holds.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, DynamicCache, get_layer_types_and_kwargs

from ..kv import PagedKV, PagedStore
from ..model import CACHE_ATTENTION_NAME

_ATTENTION_LAYERS = {"full_attention": False, "sliding_attention": True, "chunked_attention": True}  # -> is_sliding


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the shared store: its own length, the store's tables and pages.

    Sliding-window and chunked layers keep every position (the attention mask applies the window), so
    `get_mask_sizes` is the full layer's for both.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, store: PagedStore, index: int, is_sliding: bool = False, attention_config=None):
        self.store = store
        self.index = index
        self.is_sliding = is_sliding
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


class PagedCache(DynamicCache):
    """A transformers `Cache` on paged memory; a `DynamicCache` to code that asks (it grows as generation goes, and
    iterating it yields each layer's K/V as DynamicCache does), with none of DynamicCache's storage.

    `PagedCache(config, block_size=16, num_blocks=None, kv_cache_memory=None)`: with neither size the pool grows as
    needed (doubling); `num_blocks` fixes it (running out raises `MemoryError`); `kv_cache_memory` (bytes) fixes it
    to what fits, counted with the config's K/V shape. `num_bytes_in_use` is the bytes of the blocks its tables
    hold (blocks shared by several rows count once). Without a config, layers are added as the model writes them.
    """

    def __init__(self, config=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None):
        if num_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give PagedCache num_blocks or kv_cache_memory, not both")
        if kv_cache_memory is not None:
            num_blocks = _blocks_in_budget(config, block_size, kv_cache_memory)
        self.store = PagedStore(block_size, num_blocks)
        layers = _layers_for(config, self.store) if config is not None else None
        Cache.__init__(self, layers=layers if layers is not None else [], offloading=False)  # not DynamicCache's

    @property
    def num_bytes_in_use(self) -> int:
        return self.store.num_bytes_in_use

    @property
    def block_size(self) -> int:
        return self.store.block_size

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # built without a config: one paged layer per layer written
            self.layers.append(PagedLayer(self.store, len(self.layers)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _paged(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` positions (HF's convention: a negative count) and free the blocks
        no row needs any more."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        for layer in self._paged():
            layer.crop(tokens_to_remove)
        self.store.truncate(max((layer.length for layer in self._paged()), default=0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select_rows([int(i) for i in beam_idx.reshape(-1).tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = torch.arange(self.store.num_rows)[torch.as_tensor(indices).cpu()]
        self.store.select_rows(rows.reshape(-1).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.select_rows([row for row in range(self.store.num_rows) for _ in range(repeats)])

    def reset(self) -> None:
        self.store.clear()
        for layer in self._paged():
            layer.reset()


def _layers_for(config, store: PagedStore) -> list:
    text = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text)
    layers = []
    for index, layer_type in enumerate(layer_types):
        if layer_type == "dummy":
            layers.append(DummyLayer())
        elif layer_type in _ATTENTION_LAYERS:
            layers.append(PagedLayer(store, index, _ATTENTION_LAYERS[layer_type], text))
        else:
            raise ValueError(f"PagedCache holds attention K/V only; {getattr(text, 'model_type', 'this model')!r} "
                             f"has layers of type {layer_type!r}")
    return layers


def _blocks_in_budget(config, block_size: int, budget: int) -> int:
    if config is None:
        raise ValueError("kv_cache_memory needs the model config (to know the size of a block)")
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = getattr(text, "dtype", None)
    itemsize = torch.empty((), dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32).element_size()
    per_block = 2 * text.num_hidden_layers * block_size * heads * head_dim * itemsize
    if budget < per_block:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no block of {per_block} bytes")
    return budget // per_block
