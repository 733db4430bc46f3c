"""The "paged_cache" attention implementation: transformers' sdpa attention for models that run their own loop on a
`PagedCache`, except that decodes read the cache's pages in place instead of a gathered copy.

A `PagedCache` layer whose model runs this implementation hands attention a `kv.PagedKV` (this call's new K/V and
where the layer's pages are) rather than K/V tensors. Then:

- a first forward (the pages hold only this call's tokens) runs sdpa on the new K/V, as HF does;
- a decode (one query per row) on CPU in fp32 runs the native decode kernel over the block tables, with HF's sdpa
  mask reduced to one key mask per row (padding and windows are in it; no mask means plain causal, as for sdpa);
- anything else (chunks of several queries over a past, GPUs, half precision, masks the kernel cannot take, softcap
  or other arguments sdpa itself refuses or handles) runs sdpa on a gathered copy, exactly as before.

Given ordinary tensors (another cache, or none) it is transformers' sdpa attention unchanged, and its mask function is
sdpa's: a thread that meets the model while this implementation is switched on gets sdpa's results.
"""
from __future__ import annotations

import torch

from ..attention import decode_choice
from ..attention.cpu_kernel import load_cpu_kernel, usable
from ..kv import PagedKV

CACHE_ATTENTION_NAME = "paged_cache"
# the keywords transformers' sdpa attention reads besides dropout and scaling (it ignores every other, and is_causal
# changes nothing for one query): a call with any of them set is left to sdpa itself
_SDPA_READS = ("softcap", "output_attentions", "position_bias")


def cache_attention_forward(module, query: torch.Tensor, key, value, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query [B, H, q, D] -> ([B, q, H, D], None), as sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(key, PagedKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if key.length == query.shape[2]:  # the pages hold nothing but this call's tokens
        return sdpa_attention_forward(module, query, key.new_keys, key.new_values, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = decode_in_place(query, key, attention_mask, scaling, dropout, kwargs)
    if out is not None:
        return out, None
    keys, values = key.gathered()
    return sdpa_attention_forward(module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def decode_in_place(query: torch.Tensor, paged: PagedKV, attention_mask: torch.Tensor | None, scaling: float | None,
                    dropout: float, kwargs: dict) -> torch.Tensor | None:
    """One query per row over the pages, with the native CPU kernel: [B, 1, H, D], or None where the kernel does not
    apply (then the caller gathers)."""
    pages = paged.pages
    batch, _, num_queries, head_dim = query.shape
    if num_queries != 1 or dropout or any(kwargs.get(name) not in (None, False) for name in _SDPA_READS):
        return None
    if not usable(query, pages.keys) or not pages.values.is_contiguous():
        return None
    key_mask = _key_mask(attention_mask, batch, paged.length)
    if key_mask is False:
        return None
    path, _ = decode_choice.pick(decode_choice.key_of(query.dtype, query.shape[1], pages.keys.shape[2], head_dim,
                                                      pages.keys.shape[1]), may_time=False)  # HF's loop: not timed
    kernel = load_cpu_kernel() if path != decode_choice.BASELINE else None
    if kernel is None:  # no kernel, or torch's path measured faster for this shape: the caller gathers
        return None
    table = paged.store.table_tensor(query.device)
    context_lens = torch.full((batch,), paged.length, dtype=torch.int64)
    scale = scaling if scaling is not None else head_dim ** -0.5
    out = kernel(query[:, :, 0], pages.keys, pages.values, table, context_lens, scale, None, None, key_mask=key_mask,
                 path=decode_choice.kernel_path(path))
    return out.unsqueeze(1)


def _key_mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None | bool:
    """sdpa's mask for one query per row ([B or 1, 1, 1, >= length] bool; None: every key) as [B, length] bool, or
    False where it is not that (a float mask, another shape) or leaves a row no key (sdpa has its own rule there)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1:3] != (1, 1) \
            or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[3] < length:
        return False
    keys = attention_mask[:, 0, 0, :length].expand(batch, length)
    if not bool(keys.any(dim=-1).all()):
        return False
    return keys


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CACHE_ATTENTION_NAME, cache_attention_forward)
    AttentionMaskInterface.register(CACHE_ATTENTION_NAME, sdpa_mask)


def unregister() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping.pop(CACHE_ATTENTION_NAME, None)
    AttentionMaskInterface._global_mapping.pop(CACHE_ATTENTION_NAME, None)
