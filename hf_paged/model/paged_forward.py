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
    num_calls: int = 0  # attention calls that reached the paged function in this forward (one per layer)


# keywords an attention module may pass that change nothing here (the engine's own, or flags it already honours)
IGNORED_KEYWORDS = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits",
                              "output_attentions", "is_causal", "layer_idx"})


class UnsupportedAttention(ValueError):
    """The model's attention asks for something the paged attention does not implement."""


def check_supported(module, args: tuple, dropout: float, kwargs: dict) -> None:
    """Refuse, naming the model type and the feature, anything this function would otherwise ignore: extra
    positional arguments, a per-head sink (`s_aux` / `sinks`), an attention bias (ALiBi), unknown keywords with a
    value, dropout in training mode, a non-causal call. Silently wrong attention is worse than none."""
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    if args:
        raise UnsupportedAttention(f"model type {model_type!r}: its attention passes {len(args)} extra positional "
                                   f"argument(s), which hf_paged's paged attention does not implement")
    if dropout:
        raise UnsupportedAttention(f"model type {model_type!r}: attention dropout {dropout} (the model is in "
                                   f"training mode; call model.eval())")
    if kwargs.get("is_causal") is False:
        raise UnsupportedAttention(f"model type {model_type!r}: non-causal attention is not supported")
    odd = sorted(k for k, v in kwargs.items() if k not in IGNORED_KEYWORDS and v is not None and v is not False)
    if odd:
        raise UnsupportedAttention(f"model type {model_type!r}: its attention passes {odd}, which hf_paged's paged "
                                   f"attention does not implement (e.g. attention sinks or an attention bias)")


def paged_attention_forward(module, query, key, value, attention_mask, *args, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, paged_context: PagedForwardContext | None = None,
                            **kwargs):
    """transformers calls this with query [1, H, T, D], key/value [1, H_kv, T, D] (packed step, positions
    already rotated). Stores the new K/V in their slots and attends over each sequence's pages. Anything else the
    module asks for is refused (`check_supported`), never ignored."""
    if paged_context is None:
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise UnsupportedAttention(f"the 'paged' attention implementation got no paged_context: it runs only inside "
                                   f"hf_paged's engine, and a model of type {model_type!r} must pass its forward's "
                                   f"keyword arguments down to its attention modules")
    sinks = kwargs.pop("s_aux", None)  # per-head attention-sink logits (gpt-oss, granite_swa, flint)
    if args or dropout or kwargs:
        check_supported(module, args, dropout, kwargs)
    paged_context.num_calls += 1
    layer = module.layer_idx
    cache = paged_context.kv_cache
    if key.shape[1] != cache.spec.num_kv_heads or key.shape[3] != cache.spec.head_dim:
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise UnsupportedAttention(f"model type {model_type!r}: layer {layer} produces K/V with {key.shape[1]} heads of "
                                   f"size {key.shape[3]}, but its config describes {cache.spec.num_kv_heads} of size "
                                   f"{cache.spec.head_dim}")
    meta = paged_context.metadata
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    scales = cache.scales_for(layer, k, v)
    store_kv(k, v, cache.key_caches[layer], cache.value_caches[layer], meta.slot_mapping, *scales)
    out = paged_context.backends.attend(q, cache.key_caches[layer], cache.value_caches[layer], meta, scaling,
                                        sliding_window, softcap, key=k, value=v, kv_scales=scales, sinks=sinks)
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
