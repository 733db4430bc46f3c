"""Reference paged attention in plain torch: works on any device and dtype (the `torch` backend,
attention/backends/torch_sdpa.py, calls `torch_paged_attention`). Also the cache write every backend relies on:
`store_kv` (with fp8 `quantize`).

Dense groups (see `SequenceGroupPlan`): gather the group's pages into [G, L, H_kv, D] with one
index_select per cache, attend with a bool mask through SDPA (GQA without repeating K/V), and scatter
the rows back. Fresh prompts attend over their own new K/V with causal SDPA (no gather, no padding,
masked-out blocks skipped). Soft-capped logits take a matmul path that views each GQA group's query
heads as rows of one matrix, so every K/V head is still read once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_kernel import load_cpu_kernel, usable
from .metadata import AttentionMetadata, SequenceGroupPlan


FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0


def quantize(values: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Values as stored in a cache of `cache_dtype`: fp8 caches hold values / scale, saturated to the fp8 range."""
    if cache_dtype in FP8_DTYPES:
        return (values.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return values.to(cache_dtype)


def dequantize(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if stored.dtype in FP8_DTYPES:
        return stored.to(dtype) * scale
    return stored.to(dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write new tokens' K/V ([T, H_kv, D]) into their flat slots of the [num_blocks, block_size, H_kv, D] caches
    (quantized with the per-layer scales when the caches are fp8)."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    for cache, new, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        stored = quantize(new, cache.dtype, scale)
        if cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel on CPU: move the bytes
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, stored)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _attend_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: SequenceGroupPlan,
                  scale: float, sliding_window: int | None, softcap: float | None, native,
                  kv_scales: tuple[float, float] = (1.0, 1.0), sinks: torch.Tensor | None = None) -> torch.Tensor:
    if native is not None and plan.max_query_len == 1:
        return native(query[plan.rows], key_cache, value_cache, plan.block_tables, plan.context_lens.view(-1),
                      scale, sliding_window, softcap)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    groups, max_q = plan.query_index.shape
    q = query[plan.query_index].transpose(1, 2)  # [G, H, Q, D]
    k = key_cache.index_select(0, plan.flat_tables).view(groups, plan.kv_len, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache.index_select(0, plan.flat_tables).view(groups, plan.kv_len, num_kv_heads, head_dim).transpose(1, 2)
    k, v = dequantize(k, q.dtype, kv_scales[0]), dequantize(v, q.dtype, kv_scales[1])
    allowed = plan.mask(sliding_window)  # [G, 1, Q, L]
    if softcap or sinks is not None:
        out = _softcapped(q, k, v, allowed, scale, softcap, sinks)
    else:
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed, scale=scale,
                                             enable_gqa=True)
    return out.transpose(1, 2).reshape(groups * max_q, num_heads, head_dim)[plan.valid]


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with explicit scores: tanh logit soft-capping and / or per-head attention sinks (SDPA has neither).
    q [B, H, Q, D]; k, v [B, H_kv, L, D]; query heads are viewed as [H_kv, heads_per_kv * Q] rows so each K/V head is
    read once per group. `sinks` [H]: a per-head logit that joins each row's softmax denominator (after scaling and
    capping of the real scores) and contributes no value, as gpt-oss's attention defines it."""
    batch, num_heads, max_q, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    per_kv = num_heads // num_kv_heads
    dtype = _compute_dtype(q.dtype)
    rows = q.to(dtype).reshape(batch, num_kv_heads, per_kv * max_q, head_dim)
    scores = torch.matmul(rows, k.to(dtype).transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, num_kv_heads, per_kv, max_q, kv_len).masked_fill_(~allowed[:, :, None],
                                                                                  float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).view(1, num_kv_heads, per_kv, 1, 1).expand(batch, -1, -1, max_q, 1)
        scores = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :kv_len]
        probs = scores.reshape(batch, num_kv_heads, per_kv * max_q, kv_len)
    else:
        probs = scores.softmax(dim=-1).view(batch, num_kv_heads, per_kv * max_q, kv_len)
    return torch.matmul(probs, v.to(dtype)).view(batch, num_heads, max_q, head_dim).to(q.dtype)


def _window_mask(length: int, sliding_window: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(length, device=device)
    offset = pos[:, None] - pos[None, :]
    return (offset >= 0) & (offset < sliding_window)


def _attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One prompt with nothing cached: q [L, H, D], k/v [L, H_kv, D] -> [L, H, D]."""
    length = query.shape[0]
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, L, D]
    windowed = sliding_window is not None and sliding_window < length
    if softcap or sinks is not None:
        allowed = (_window_mask(length, sliding_window, query.device) if windowed
                   else torch.ones(length, length, dtype=torch.bool, device=query.device).tril_())
        out = _softcapped(q, k, v, allowed[None, None], scale, softcap, sinks)
    elif windowed:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True,
                                             attn_mask=_window_mask(length, sliding_window, query.device))
    else:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def torch_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                          softcap: float | None = None, key: torch.Tensor | None = None,
                          value: torch.Tensor | None = None, native_decode: bool = False,
                          kv_scales: tuple[float, float] = (1.0, 1.0), sinks: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """query [T, H, D] -> output [T, H, D]; the new tokens' K/V must already be stored.
    With the new tokens' `key` / `value` ([T, H_kv, D]) fresh prompts skip the page gather.
    `native_decode` lets fp32 decodes on CPU use the native kernel when it could be built (not with `sinks`, per-head
    attention-sink logits [H], which the explicit-scores path implements)."""
    use_native = native_decode and sinks is None and usable(query, key_cache)
    native = load_cpu_kernel() if use_native else None
    if key_cache.dtype in FP8_DTYPES:  # fresh prompts too attend over what the pages hold, as every later step does
        key = value = None
    if native is not None and metadata.num_decode_groups:
        decodes = metadata.all_decodes()  # one kernel call for every decode: it needs no split by length
        if decodes.rows.numel() == query.shape[0]:  # a pure decode step: rows are 0..T-1 in order
            return native(query, key_cache, value_cache, decodes.block_tables, decodes.context_lens.view(-1),
                          scale, sliding_window, softcap)
        groups = [decodes, *metadata.other_groups()]
    else:
        groups = [*metadata.decode_groups(), *metadata.other_groups()]
    out = torch.empty_like(query)
    for plan in groups:
        out.index_copy_(0, plan.rows, _attend_group(query, key_cache, value_cache, plan, scale, sliding_window, softcap,
                                                    native, kv_scales, sinks))
    for start, end in metadata.fresh:
        if key is None:
            key = dequantize(_gather_rows(key_cache, metadata), query.dtype, kv_scales[0])
            value = dequantize(_gather_rows(value_cache, metadata), query.dtype, kv_scales[1])
        out[start:end] = _attend_fresh(query[start:end], key[start:end], value[start:end], scale, sliding_window,
                                       softcap, sinks)
    return out


def _gather_rows(cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """The packed rows' K or V read back from their slots."""
    return cache.view(-1, *cache.shape[2:])[metadata.slot_mapping]
