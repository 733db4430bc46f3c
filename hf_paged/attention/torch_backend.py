"""Reference paged attention in plain torch: works on any device and dtype (the `torch` backend,
attention/backends/torch_sdpa.py, calls `torch_paged_attention`). Also the cache write every backend relies on:
`store_kv` (with fp8 `quantize`).

Dense tiles (see `DenseTile`): gather the tile's pages into [G, L, H_kv, D] with one
index_select per cache, attend with a bool mask through SDPA (GQA without repeating K/V), and scatter
the rows back. Fresh prompts attend over their own new K/V with causal SDPA (no gather, no padding,
masked-out blocks skipped). Soft-capped logits, ALiBi, relative-position logits and attention sinks (`LayerExtras`)
take a matmul path that views each GQA group's query heads as rows of one matrix, so every K/V head is still read
once; attention chunks only change the mask. Relative-position logits never reach the native decode kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from . import decode_choice, prefill_kernel
from .cpu_kernel import load_cpu_kernel, usable
from .extras import LayerExtras, alibi_bias, relative_bias
from .extras import allowed as allowed_mask
from .metadata import AttentionMetadata, DenseTile


FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0


def quantize(values: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Values as stored in a cache of `cache_dtype`: fp8 caches hold values / scale, saturated to the fp8 range."""
    if cache_dtype in FP8_DTYPES:
        return (values.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return values if values.dtype == cache_dtype else values.to(cache_dtype)


def dequantize(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if stored.dtype in FP8_DTYPES:
        return stored.to(dtype) * scale
    return stored.to(dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write new tokens' K/V ([T, H_kv, D]) into their flat slots of the [num_blocks, block_size, H_kv, D] caches
    (quantized with the per-layer scales when the caches are fp8)."""
    for cache, new, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        stored = quantize(new, cache.dtype, scale)
        if cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel on CPU: move the bytes
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, stored)
        else:  # a page of a layer smaller than the largest (kv/cache.py): pages strided by the largest
            block_size = cache.shape[1]
            cache[slot_mapping // block_size, slot_mapping % block_size] = stored


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _attend_tile(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: DenseTile,
                  scale: float, sliding_window: int | None, softcap: float | None, native,
                  kv_scales: tuple[float, float] = (1.0, 1.0), extras: LayerExtras | None = None) -> torch.Tensor:
    if native is not None and plan.max_query_len == 1:
        return native(query[plan.rows], key_cache, value_cache, plan.block_tables, plan.context_lens.view(-1),
                      scale, sliding_window, softcap, extras)
    chunk = extras.chunk_size if extras is not None else None

    def torch_path() -> torch.Tensor:
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = key_cache.shape[2]
        seqs, max_q = plan.query_index.shape
        q = query[plan.query_index].transpose(1, 2)  # [G, H, Q, D]
        k, v = (cache.index_select(0, plan.flat_tables).view(seqs, plan.kv_len, num_kv_heads, head_dim)
                .transpose(1, 2) for cache in (key_cache, value_cache))
        k, v = dequantize(k, q.dtype, kv_scales[0]), dequantize(v, q.dtype, kv_scales[1])
        allowed = plan.mask(sliding_window, chunk)  # [G, 1, Q, L]
        if softcap or _scored(extras):
            positions = (plan.positions(), torch.arange(plan.kv_len, device=q.device))
            rows = None if extras is None else extras.relative_logits
            relative = None if rows is None else rows[plan.query_index]  # [G, Q, H, E]
            out = _explicit(q, k, v, allowed, scale, softcap, extras, positions, relative)
        else:
            out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed, scale=scale,
                                                 enable_gqa=True)
        return out.transpose(1, 2).reshape(seqs * max_q, num_heads, head_dim)[plan.valid]

    if plan.max_query_len == 1 or not query.is_cpu or (extras is not None and
                                                       not extras.names() <= prefill_kernel.EXTRAS):
        return torch_path()  # decodes: decode_choice's (torch's path here)
    # prompts after cached keys: torch's padded tile or the native kernel per sequence, whichever measured faster
    def sequences() -> list[tuple]:  # (query rows, blocks, keys) of each sequence: only where the kernel runs
        query_lens, keys = plan.query_lens.view(-1).tolist(), plan.context_lens.view(-1).tolist()
        per_block = key_cache.shape[1]
        return [(plan.query_index[g, :query_lens[g]], plan.block_tables[g, :-(-keys[g] // per_block)], keys[g])
                for g in range(len(keys))]

    return prefill_kernel.attend_from_pages(query, key_cache, value_cache, sequences, int(plan.context_lens.max()),
                                            scale, torch_path, sliding_window, chunk, softcap,
                                            None if extras is None else extras.sinks)


def _scored(extras: LayerExtras | None) -> bool:
    """Whether `extras` change the scores themselves (sinks, ALiBi, relative logits): only `_explicit` has them."""
    return extras is not None and not extras.names() <= {"chunked"}


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
              softcap: float | None, extras: LayerExtras | None = None, positions: tuple | None = None,
              relative: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with explicit scores: tanh logit soft-capping, ALiBi, relative-position logits and / or per-head
    attention sinks (SDPA has none of them; see LayerExtras for their definitions). q [B, H, Q, D]; k, v
    [B, H_kv, L, D]; `positions`: (query positions [B, Q], key positions [L]) for ALiBi and relative logits;
    `relative`: each query's relative logits [B, Q, H, E]. Query heads are viewed as [H_kv, heads_per_kv * Q] rows
    so each K/V head is read once per group."""
    batch, num_heads, max_q, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    per_kv = num_heads // num_kv_heads
    dtype = _compute_dtype(q.dtype)
    rows = q.to(dtype).reshape(batch, num_kv_heads, per_kv * max_q, head_dim)
    scores = torch.matmul(rows, k.to(dtype).transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, num_kv_heads, per_kv, max_q, kv_len)
    if extras is not None and extras.alibi_slopes is not None:
        bias = alibi_bias(extras.alibi_slopes, positions[0], positions[1])  # [B, H, Q, L]
        scores = scores + bias.to(dtype).view(batch, num_kv_heads, per_kv, max_q, kv_len)
    if relative is not None:
        bias = relative_bias(relative, positions[0], positions[1])  # [B, H, Q, L]
        scores = scores + bias.to(dtype).view(batch, num_kv_heads, per_kv, max_q, kv_len)
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    if extras is not None and extras.sinks is not None:
        sink = extras.sinks.to(dtype).view(1, num_kv_heads, per_kv, 1, 1).expand(batch, -1, -1, max_q, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :kv_len]
        probs = probs.reshape(batch, num_kv_heads, per_kv * max_q, kv_len)
    else:
        probs = scores.softmax(dim=-1).view(batch, num_kv_heads, per_kv * max_q, kv_len)
    return torch.matmul(probs, v.to(dtype)).view(batch, num_heads, max_q, head_dim).to(q.dtype)


def _attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  sliding_window: int | None, softcap: float | None, extras: LayerExtras | None = None
                  ) -> torch.Tensor:
    """One prompt with nothing cached: q [L, H, D], k/v [L, H_kv, D] -> [L, H, D] (`extras.relative_logits`, if any:
    this prompt's rows)."""
    length = query.shape[0]
    chunk = extras.chunk_size if extras is not None else None

    def torch_path() -> torch.Tensor:
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, L, D]
        pos = torch.arange(length, device=query.device)
        limited = bool(sliding_window and sliding_window < length) or bool(chunk and chunk < length)
        if softcap or _scored(extras):
            mask = allowed_mask(pos, pos, sliding_window, chunk)
            relative = None if extras is None or extras.relative_logits is None else extras.relative_logits[None]
            out = _explicit(q, k, v, mask[None, None], scale, softcap, extras, (pos[None], pos), relative)
        elif limited:
            out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True,
                                                 attn_mask=allowed_mask(pos, pos, sliding_window, chunk))
        else:
            out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)

    if extras is not None and not extras.names() <= prefill_kernel.EXTRAS:
        return torch_path()
    # torch's path or the native kernel, whichever measured faster for this shape and these limits (prefill_kernel)
    return prefill_kernel.attend(query, key, value, scale, torch_path, sliding_window, chunk, softcap,
                                 None if extras is None else extras.sinks)


def torch_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                          softcap: float | None = None, key: torch.Tensor | None = None,
                          value: torch.Tensor | None = None, native_decode: bool = False,
                          kv_scales: tuple[float, float] = (1.0, 1.0), extras: LayerExtras | None = None
                          ) -> torch.Tensor:
    """query [T, H, D] -> output [T, H, D]; the new tokens' K/V must already be stored.
    With the new tokens' `key` / `value` ([T, H_kv, D]) fresh prompts skip the page gather.
    `native_decode` lets fp32 and bf16 decodes on CPU use the native kernel when it could be built (it implements the
    LayerExtras too). `extras`: sinks / ALiBi / attention chunks of this layer (None: plain attention)."""
    if extras is not None and not extras.any():
        extras = None
    use_native = native_decode and usable(query, key_cache) and (extras is None or extras.relative_logits is None)
    run = functools.partial(_paged_attention, query, key_cache, value_cache, metadata, scale, sliding_window, softcap,
                            key, value, kv_scales, extras)
    if not use_native:
        return run(None)
    # the path measured fastest for this layer shape (decode_choice), torch's own included; pure decode steps time it
    choice = decode_choice.key_of(query.dtype, query.shape[1], key_cache.shape[2], query.shape[2], key_cache.shape[1])
    pure = metadata.decode_tables() is not None
    path, timed = decode_choice.pick(choice, may_time=pure)
    kernel = load_cpu_kernel() if path != decode_choice.BASELINE else None
    native = functools.partial(kernel, path=decode_choice.kernel_path(path)) if kernel is not None else None
    out, _ = decode_choice.TABLE.timed(choice, path if timed else None, lambda: run(native))
    return out


def _paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     metadata: AttentionMetadata, scale: float, sliding_window: int | None, softcap: float | None,
                     key: torch.Tensor | None, value: torch.Tensor | None, kv_scales: tuple[float, float],
                     extras: LayerExtras | None, native) -> torch.Tensor:
    """`torch_paged_attention` with `native` the kernel (bound to its path) for decodes, or None: torch's path."""
    if key_cache.dtype in FP8_DTYPES:  # fresh prompts too attend over what the pages hold, as every later step does
        key = value = None
    if native is not None and metadata.num_decode_tiles:
        pure = metadata.decode_tables()
        if pure is not None:  # a pure decode step: row b is sequence b's
            return native(query, key_cache, value_cache, *pure, scale, sliding_window, softcap, extras)
        tiles = [metadata.all_decodes(), *metadata.other_tiles()]  # one kernel call for every decode
    else:
        tiles = [*metadata.decode_tiles(), *metadata.other_tiles()]
    out = torch.empty_like(query)
    for plan in tiles:
        out.index_copy_(0, plan.rows, _attend_tile(query, key_cache, value_cache, plan, scale, sliding_window, softcap,
                                                    native, kv_scales, extras))
    for start, end in metadata.fresh:
        fresh = extras if extras is None or extras.relative_logits is None else \
            dataclasses.replace(extras, relative_logits=extras.relative_logits[start:end])
        if key is None:
            key = dequantize(_gather_rows(key_cache, metadata), query.dtype, kv_scales[0])
            value = dequantize(_gather_rows(value_cache, metadata), query.dtype, kv_scales[1])
        out[start:end] = _attend_fresh(query[start:end], key[start:end], value[start:end], scale, sliding_window,
                                       softcap, fresh)
    return out


def _gather_rows(cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """The packed rows' K or V read back from their slots."""
    if cache.is_contiguous():
        return cache.view(-1, *cache.shape[2:])[metadata.slot_mapping]
    slots, block_size = metadata.slot_mapping, cache.shape[1]
    return cache[slots // block_size, slots % block_size]
