"""Reference paged attention in plain torch: works on any device and dtype.

Dense groups (see `SequenceGroupPlan`): gather the group's pages into [G, L, H_kv, D], arrange the
queries as [G, H_kv, heads_per_kv * Q, D] so every query head of a GQA group shares one K/V read,
mask, softmax, and scatter the rows back. Fresh prompts attend over their own new K/V with causal SDPA
(no gather, no padding, masked-out blocks skipped).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata, SequenceGroupPlan


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, H_kv, D]) into their flat slots of the [num_blocks, block_size, H_kv, D] caches."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _attend_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: SequenceGroupPlan,
                  scale: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    groups, max_q = plan.query_index.shape
    dtype = _compute_dtype(query.dtype)

    q = query[plan.query_index].to(dtype)  # [G, Q, H, D]
    q = q.view(groups, max_q, num_kv_heads, per_kv, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(groups, num_kv_heads, per_kv * max_q, head_dim)
    k = key_cache[plan.block_tables].view(groups, plan.kv_len, num_kv_heads, head_dim).to(dtype)
    v = value_cache[plan.block_tables].view(groups, plan.kv_len, num_kv_heads, head_dim).to(dtype)

    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale  # [G, Hkv, per_kv * Q, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(groups, num_kv_heads, per_kv, max_q, plan.kv_len)
    scores = scores.masked_fill_(~plan.mask(sliding_window), float("-inf"))
    probs = scores.softmax(dim=-1).view(groups, num_kv_heads, per_kv * max_q, plan.kv_len)
    out = torch.matmul(probs, v.transpose(1, 2)).to(query.dtype)  # [G, Hkv, per_kv * Q, D]
    out = out.view(groups, num_kv_heads, per_kv, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(groups * max_q, num_heads, head_dim)[plan.valid]


def _window_mask(length: int, sliding_window: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(length, device=device)
    offset = pos[:, None] - pos[None, :]
    return (offset >= 0) & (offset < sliding_window)


def _attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """One prompt with nothing cached: q [L, H, D], k/v [L, H_kv, D] -> [L, H, D]."""
    length, num_heads, _ = query.shape
    dtype = _compute_dtype(query.dtype)
    q, k, v = (t.transpose(0, 1).to(dtype) for t in (query, key, value))  # [heads, L, D]
    windowed = sliding_window is not None and sliding_window < length
    if softcap:
        per_kv = num_heads // k.shape[0]
        k, v = k.repeat_interleave(per_kv, 0), v.repeat_interleave(per_kv, 0)
        scores = torch.tanh(torch.matmul(q, k.transpose(1, 2)) * scale / softcap) * softcap
        allowed = (_window_mask(length, sliding_window, query.device) if windowed
                   else torch.ones(length, length, dtype=torch.bool, device=query.device).tril_())
        out = torch.matmul(scores.masked_fill_(~allowed, float("-inf")).softmax(-1), v)
    elif windowed:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, enable_gqa=True,
                                             attn_mask=_window_mask(length, sliding_window, query.device))[0]
    else:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, is_causal=True,
                                             enable_gqa=True)[0]
    return out.transpose(0, 1).to(query.dtype)


def torch_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                          softcap: float | None = None, key: torch.Tensor | None = None,
                          value: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, H, D] -> output [T, H, D]; the new tokens' K/V must already be stored.
    With the new tokens' `key` / `value` ([T, H_kv, D]) fresh prompts skip the page gather."""
    out = torch.empty_like(query)
    for plan in metadata.groups:
        out.index_copy_(0, plan.rows, _attend_group(query, key_cache, value_cache, plan, scale, sliding_window, softcap))
    for start, end in metadata.fresh:
        if key is None:
            key, value = _gather_rows(key_cache, metadata), _gather_rows(value_cache, metadata)
        out[start:end] = _attend_fresh(query[start:end], key[start:end], value[start:end], scale, sliding_window,
                                       softcap)
    return out


def _gather_rows(cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """The packed rows' K or V read back from their slots."""
    return cache.view(-1, *cache.shape[2:])[metadata.slot_mapping]
