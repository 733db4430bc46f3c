"""The "paged" attention implementation as transformers sees it, plus its (empty) mask function."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

from ..attention import AttentionBackends, AttentionMetadata, store_kv
from ..kv import KVCache

ATTENTION_NAME = "paged"


@dataclass(slots=True)
class PagedForwardContext:
    """Travels through the model's forward kwargs (`paged_context=`) down to every attention call. `backends`: the
    engine's chooser (made once per engine), which names the backend object each layer's call runs on."""

    metadata: AttentionMetadata
    kv_cache: KVCache
    backends: AttentionBackends


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, paged_context: PagedForwardContext | None = None,
                            **kwargs):
    """transformers calls this with query [1, H, T, D], key/value [1, H_kv, T, D] (packed step, positions
    already rotated). Stores the new K/V in their slots and attends over each sequence's pages."""
    if paged_context is None:
        raise RuntimeError("the 'paged' attention implementation only runs inside hf_paged's engine "
                           "(no paged_context was passed to the model's forward)")
    layer = module.layer_idx
    cache = paged_context.kv_cache
    meta = paged_context.metadata
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    scales = cache.scales_for(layer, k, v)
    store_kv(k, v, cache.key_caches[layer], cache.value_caches[layer], meta.slot_mapping, *scales)
    out = paged_context.backends.attend(q, cache.key_caches[layer], cache.value_caches[layer], meta, scaling,
                                        sliding_window, softcap, key=k, value=v, kv_scales=scales)
    return out[None], None


def paged_mask(*args, **kwargs):
    """Paged attention derives causality from the metadata: transformers must build no mask."""
    return None


def forward_lock(model) -> threading.RLock:
    """The model's own lock (made on first use, kept on the model object): engines hold it for a whole forward, in
    which they switch the model's attention implementation and linear layers, so two engines (or threads) on one
    model never interleave those switches and the model is always left as it was found."""
    return model.__dict__.setdefault("_hf_paged_forward_lock", threading.RLock())  # dict.setdefault is atomic


@contextmanager
def paged_attention_active(configs: list):
    """Switch the model's configs to the "paged" implementation for one forward, restoring them after
    (even on error), so the model is left exactly as it was found."""
    saved = [c._attn_implementation_internal for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = ATTENTION_NAME
        yield
    finally:
        for c, value in zip(configs, saved):
            c._attn_implementation_internal = value


def _forget(mapping: dict, key: str) -> None:
    mapping.pop(key, None)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)


def unregister() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _forget(AttentionInterface._global_mapping, ATTENTION_NAME)
    _forget(AttentionMaskInterface._global_mapping, ATTENTION_NAME)
