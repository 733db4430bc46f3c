"""Reference paged attention in plain torch: works on any device and dtype.

Each group of sequences (see `SequenceGroupPlan`) is computed as one dense, masked batch: gather the
group's pages into [G, L, H_kv, D], multiply with the queries arranged as [G, H_kv, heads_per_kv * Q, D]
so every query head of a GQA group shares one K/V read, mask, softmax, and scatter the rows back.
"""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata, SequenceGroupPlan


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, H_kv, D]) into their flat slots of the [num_blocks, block_size, H_kv, D] caches."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _attend_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: SequenceGroupPlan,
                  scale: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    groups, max_q = plan.query_index.shape
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype

    q = query[plan.query_index]  # [G, Q, H, D]
    q = q.view(groups, max_q, num_kv_heads, per_kv, head_dim).permute(0, 2, 3, 1, 4)  # [G, Hkv, per_kv, Q, D]
    k = key_cache[plan.block_tables].view(groups, plan.kv_len, num_kv_heads, head_dim)
    v = value_cache[plan.block_tables].view(groups, plan.kv_len, num_kv_heads, head_dim)
    k = k.permute(0, 2, 3, 1)[:, :, None]  # [G, Hkv, 1, D, L]
    v = v.permute(0, 2, 1, 3)[:, :, None]  # [G, Hkv, 1, L, D]

    scores = torch.matmul(q.to(compute_dtype), k.to(compute_dtype)) * scale  # [G, Hkv, per_kv, Q, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~plan.mask(sliding_window), float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.matmul(probs, v.to(compute_dtype)).to(query.dtype)  # [G, Hkv, per_kv, Q, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(groups * max_q, num_heads, head_dim)
    return out[plan.valid]


def torch_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """query [T, H, D] -> output [T, H, D]; the new tokens' K/V must already be stored."""
    out = torch.empty_like(query)
    for plan in metadata.groups:
        out.index_copy_(0, plan.rows, _attend_group(query, key_cache, value_cache, plan, scale, sliding_window, softcap))
    return out
