"""The torch paged-attention backend against a float64 reference on random data."""
import random

import pytest
import torch

from hf_paged.attention import paged_attention, store_kv


def reference(query, keys, values, query_lens, scale, window, softcap, sinks=None, alibi=None, chunk=None,
              key_masks=None):
    """Per sequence, dense float64: keys/values hold each sequence's whole context [C, H_kv, D]. `sinks` [H]: a
    per-head logit in every row's softmax denominator that contributes no value. `alibi` [H]: slopes, the score of
    key k for the query at q gains slope * (k - q) (without sinks, the same softmax as HF bloom's slope * k).
    `chunk`: keys only from the query's own chunk (k // chunk == q // chunk). `key_masks`: per sequence, bool [C]
    (False: a key nobody attends); a query left without keys gets zeros."""
    outs, start = [], 0
    heads = query.shape[1]
    for index, (q_len, k, v) in enumerate(zip(query_lens, keys, values)):
        q = query[start:start + q_len].double()
        start += q_len
        ctx = k.shape[0]
        per_kv = heads // k.shape[1]
        kk = k.double().repeat_interleave(per_kv, 1)
        vv = v.double().repeat_interleave(per_kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        if alibi is not None:
            scores = scores + alibi.double()[:, None, None] * (k_pos - q_pos).double()
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        if chunk:
            allowed &= k_pos // chunk == q_pos // chunk
        if key_masks is not None:
            allowed &= key_masks[index][None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(heads, q_len, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :ctx]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs.nan_to_num(0.0), vv))
    return torch.cat(outs)


def make_case(seqs, heads, kv_heads, head_dim, block_size, dtype, seed):
    """seqs: list of (query_len, context_len). Pages are scattered over a shuffled pool."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for _, c in seqs) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables, keys, values, new_k, new_v, slots = [], [], [], [], [], []
    for q_len, ctx in seqs:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table)
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        # the cached part is already in the pages; the last q_len tokens are new and get stored
        for pos in range(ctx):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < ctx - q_len:
                key_cache.view(-1, kv_heads, head_dim)[slot] = k[pos]
                value_cache.view(-1, kv_heads, head_dim)[slot] = v[pos]
            else:
                slots.append(slot)
        new_k.append(k[ctx - q_len:])
        new_v.append(v[ctx - q_len:])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    total_q = sum(q for q, _ in seqs)
    query = torch.randn(total_q, heads, head_dim, generator=gen).to(dtype)
    store_kv(torch.cat(new_k), torch.cat(new_v), key_cache, value_cache, torch.tensor(slots))
    cu = torch.tensor([0] + [sum(q for q, _ in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    context_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return query, key_cache, value_cache, cu, context_lens, block_tables, keys, values


MIXED = [(1, 37), (9, 9), (1, 1), (5, 21), (16, 48), (1, 64), (30, 30)]


BACKENDS = ["torch", "auto"]  # "auto" adds the native CPU decode kernel


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (8, 1), (16, 2)])  # MHA, GQA 4, MQA, GQA 8
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_mixed_batch_matches_float64(heads, kv_heads, block_size, backend):
    case = make_case(MIXED, heads, kv_heads, 32, block_size, torch.float32, seed=heads * block_size + kv_heads)
    query, kc, vc, cu, ctx, tables, keys, values = case
    out = paged_attention(query, kc, vc, cu, ctx, tables, scale=0.2, backend=backend)
    ref = reference(query, keys, values, [q for q, _ in MIXED], 0.2, None, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, softcap", [(7, None), (None, 5.0), (12, 3.0)])
def test_sliding_window_and_softcap(window, softcap, backend):
    query, kc, vc, cu, ctx, tables, keys, values = make_case(MIXED, 4, 2, 16, 8, torch.float32, seed=11)
    out = paged_attention(query, kc, vc, cu, ctx, tables, scale=0.25, sliding_window=window, softcap=softcap,
                          backend=backend)
    ref = reference(query, keys, values, [q for q, _ in MIXED], 0.25, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision(dtype, tol):
    query, kc, vc, cu, ctx, tables, keys, values = make_case(MIXED, 8, 2, 64, 16, dtype, seed=3)
    out = paged_attention(query, kc, vc, cu, ctx, tables, scale=0.125)
    assert out.dtype == dtype
    ref = reference(query, keys, values, [q for q, _ in MIXED], 0.125, None, None)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_unknown_or_unavailable_backend_is_a_clear_error():
    query, kc, vc, cu, ctx, tables, *_ = make_case([(1, 4)], 2, 1, 8, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="attention_backend 'cuda' cannot run on cpu: .*CUDA tensors"):
        paged_attention(query, kc, vc, cu, ctx, tables, backend="cuda")
    with pytest.raises(ValueError, match="unknown attention backend 'flash4'"):
        paged_attention(query, kc, vc, cu, ctx, tables, backend="flash4")


def test_fp8_cache_with_per_layer_scales():
    """fp8 e4m3 pages hold value / scale; the torch backend dequantizes. Error stays at fp8 precision."""
    query, kc, vc, cu, ctx, tables, keys, values = make_case(MIXED, 8, 2, 32, 16, torch.float32, seed=21)
    k_scale, v_scale = float(kc.abs().max()) / 224, float(vc.abs().max()) / 224
    kq = (kc / k_scale).to(torch.float8_e4m3fn)
    vq = (vc / v_scale).to(torch.float8_e4m3fn)
    out = paged_attention(query, kq, vq, cu, ctx, tables, scale=0.2, backend="torch", kv_scales=(k_scale, v_scale))
    ref = reference(query, keys, values, [q for q, _ in MIXED], 0.2, None, None)
    error = (out.double() - ref).abs().max().item()
    assert error < 0.15, error
    unscaled = paged_attention(query, kq, vq, cu, ctx, tables, scale=0.2, backend="torch")
    assert (unscaled.double() - ref).abs().max().item() > 5 * error  # the scales really are applied


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 5.0)])
def test_attention_sinks_match_float64(backend, window, softcap):
    """Per-head sink logits (gpt-oss) join the softmax denominator: decodes, fresh prompts and chunks, GQA, with a
    window or soft-cap ("auto" would otherwise take the native decode kernel, which has no sink input)."""
    query, kc, vc, cu, ctx, tables, keys, values = make_case(MIXED, 8, 2, 16, 8, torch.float32, seed=5)
    sinks = torch.linspace(-2.0, 3.0, 8)
    out = paged_attention(query, kc, vc, cu, ctx, tables, scale=0.3, sliding_window=window, softcap=softcap,
                          backend=backend, sinks=sinks)
    ref = reference(query, keys, values, [q for q, _ in MIXED], 0.3, window, softcap, sinks)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    plain = reference(query, keys, values, [q for q, _ in MIXED], 0.3, window, softcap)
    assert (out.double() - plain).abs().max() > 1e-2  # the sinks really change the result
