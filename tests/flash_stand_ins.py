"""Stand-ins for FlashAttention-3, FlashAttention-2 and FlashInfer (tests/test_flash_dispatch.py): modules that record
the arguments a backend passes and compute, in float64, the attention those arguments describe by each library's
documented rules (bottom-right causal mask, windows, soft-capping, pages read through the page table / CSR list)."""
import importlib.machinery
import types

import torch


# ---- the libraries' semantics ----------------------------------------------------------------------------
def library_attention(q, k, v, scale, causal, left, right, softcap):
    """One sequence by a flash library's rules: q [Lq, H, D], k / v [Lk, H_kv, D]; query i sits at i + Lk - Lq;
    left / right < 0 mean unlimited; softcap 0 means off."""
    q_len, heads, _ = q.shape
    k_len, kv_heads = k.shape[:2]
    kk = k.double().repeat_interleave(heads // kv_heads, 1)
    vv = v.double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(q_len)[:, None] + k_len - q_len
    key = torch.arange(k_len)[None, :]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:
        allowed &= key <= pos
    elif right >= 0:
        allowed &= key <= pos + right
    if left >= 0:
        allowed &= key >= pos - left
    out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    return out.to(q.dtype)


def pages_of(cache, page_ids, length):
    return cache[page_ids.long()].reshape(-1, *cache.shape[2:])[:length]


def paged_sequences(q, k_cache, v_cache, cu_q, lengths, table, scale, causal, window_size, softcap):
    """Each sequence b (queries cu_q[b]:cu_q[b + 1], `lengths[b]` keys in the pages `table[b]` lists) by
    `library_attention`."""
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    for b, length in enumerate(lengths):
        ids = table[b, :-(-length // page)]
        out[cu_q[b]:cu_q[b + 1]] = library_attention(q[cu_q[b]:cu_q[b + 1]], pages_of(k_cache, ids, length),
                                                     pages_of(v_cache, ids, length), scale, causal, window_size[0],
                                                     window_size[1], softcap)
    return out


def check_half(t, name):
    assert t.dtype in (torch.float16, torch.bfloat16), f"{name} dtype {t.dtype}"
    assert t.stride(-1) == 1, f"{name} needs a contiguous last dim"


def check_int32(t, name):
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    assert t.is_contiguous(), f"{name} must be contiguous"


# ---- stand-in modules (signatures as in the real libraries) ------------------------------------------------
def stand_in(name):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # importlib.util.find_spec works while installed
    return module


def fake_fa3(calls):
    module = stand_in("flash_attn_interface")

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        calls.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                          page_table=page_table, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                          softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap))
        check_half(q, "q")
        for name in ("cache_seqlens", "page_table", "cu_seqlens_q"):
            check_int32(calls[-1][name], name)
        assert q.is_contiguous() and q.dim() == 3 and max_seqlen_q is not None
        return paged_sequences(q, k_cache, v_cache, cu_seqlens_q.tolist(), cache_seqlens.tolist(), page_table,
                               softmax_scale, causal, window_size, softcap)

    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def fake_fa2(calls, version="2.7.4"):
    module = stand_in("flash_attn")
    module.__version__ = version

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        calls.append(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                          causal=causal, window_size=window_size, softcap=softcap, block_table=block_table,
                          dropout_p=dropout_p))
        check_half(q, "q")
        for name in ("cu_seqlens_q", "cu_seqlens_k", "block_table"):
            check_int32(calls[-1][name], name)
        assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"  # FA2's own check
        cu_k = cu_seqlens_k.tolist()
        lengths = [cu_k[b + 1] - cu_k[b] for b in range(len(cu_k) - 1)]
        return paged_sequences(q, k, v, cu_seqlens_q.tolist(), lengths, block_table, softmax_scale, causal,
                               window_size, softcap)

    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def fake_flashinfer(calls):
    module = stand_in("flashinfer")

    class _Wrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", **options):
            assert kv_layout == "NHD"
            calls.append(("init", type(self).__name__, options))
            self.plan_args = None

        def _planned(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, page_size,
                     causal, window_left, logits_soft_cap, sm_scale):
            for name, t in (("qo_indptr", qo_indptr), ("paged_kv_indptr", kv_indptr),
                            ("paged_kv_indices", kv_indices), ("paged_kv_last_page_len", last_page_len)):
                check_int32(t, name)
            assert bool(((last_page_len >= 1) & (last_page_len <= page_size)).all())
            self.plan_args = (qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads,
                              page_size, causal, window_left, logits_soft_cap, sm_scale)

        def run(self, q, paged_kv_cache, *args, **kwargs):
            calls.append(("run", type(self).__name__, q))
            check_half(q, "q")
            k_cache, v_cache = paged_kv_cache
            qo, kv_indptr, indices, last, heads, kv_heads, page, causal, left, cap, scale = self.plan_args
            assert q.shape[1] == heads and k_cache.shape[2] == kv_heads and k_cache.shape[1] == page
            out = torch.empty_like(q)
            qo, kv_indptr, last = qo.tolist(), kv_indptr.tolist(), last.tolist()
            for b in range(len(qo) - 1):
                ids = indices[kv_indptr[b]:kv_indptr[b + 1]]
                length = (len(ids) - 1) * page + last[b]
                out[qo[b]:qo[b + 1]] = library_attention(q[qo[b]:qo[b + 1]], pages_of(k_cache, ids, length),
                                                         pages_of(v_cache, ids, length), scale, causal, left, -1,
                                                         cap or 0.0)
            return out

    class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                 num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
                 causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
                 logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
                 non_blocking=True):
            calls.append(("plan", "prefill", dict(window_left=window_left, logits_soft_cap=logits_soft_cap,
                                                  sm_scale=sm_scale, causal=causal, q_data_type=q_data_type,
                                                  kv_data_type=kv_data_type, pos_encoding_mode=pos_encoding_mode,
                                                  qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr,
                                                  paged_kv_indices=paged_kv_indices,
                                                  paged_kv_last_page_len=paged_kv_last_page_len)))
            self._planned(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                          num_kv_heads, page_size, causal, window_left, logits_soft_cap, sm_scale)

    class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
                 kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
                 non_blocking=True):
            calls.append(("plan", "decode", dict(window_left=window_left, logits_soft_cap=logits_soft_cap,
                                                 sm_scale=sm_scale, q_data_type=q_data_type,
                                                 kv_data_type=kv_data_type, paged_kv_indptr=indptr,
                                                 paged_kv_indices=indices, paged_kv_last_page_len=last_page_len)))
            qo = torch.arange(len(indptr), dtype=torch.int32)  # one query per sequence
            self._planned(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, page_size, True,
                          window_left, logits_soft_cap, sm_scale)

    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    return module
