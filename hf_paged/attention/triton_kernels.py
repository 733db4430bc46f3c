"""Triton kernels behind hf_paged.attention.triton_backend (imported only when triton is installed).

Importing this module defines the kernels: with TRITON_INTERPRET=1 in the environment at that moment they
become interpreter functions (numpy on the CPU), otherwise compiled GPU kernels.

Layouts: queries / outputs [T, H, D] (any strides, last dim contiguous); caches [num_blocks, block_size, H_kv, D]
(last dim contiguous); block tables int32 [B, max_blocks]; cu_seqlens_q / context_lens int32.

FP8 caches (float8_e4m3fn, "fp8e4nv" in triton) hold value / scale with one (k_scale, v_scale) per layer, saturated
to +-FP8_MAX. The attention kernel upcasts fp8 tiles to the queries' dtype (exact: every e4m3 value is an fp16 / bf16
/ fp32 value), so its dots run as for unquantized caches; the host folds k_scale into the score scale and the kernel
multiplies its fp32 output accumulator by v_scale once: one rounding each, instead of one per dequantized element.

Interpreter (TRITON_INTERPRET=1) caveat: numpy has no bfloat16 or fp8, so the interpreter carries them as raw
uint16 / uint8 bits. Upcasting them to fp32 is exact there, but arithmetic on them is not, and its fp32 -> fp8 cast
is not faithful (ties round up, a mantissa carry can halve the value, no e4m3fn saturation). So interpreted kernels
upcast bf16 / fp8 loads to fp32 before any math (UPCAST) and quantize into fp8 with integer ops (SOFT_FP8).
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn (torch_backend.FP8_MAX)
NEG_BIG = -1.0e30  # running-max start: finite, so a fully masked tile gives exp2(-inf - NEG_BIG) = 0, never NaN


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Sequence b owns query tiles [cu[b] // BLOCK_Q + b, ...): strictly increasing starts, so the owner of
    program `pid` is the last b whose start is <= pid (binary search; no host-side tile map, no sync)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Only tl builtins below, plus these wrappers: triton.language's own @jit helpers (tl.max, tl.sum, tl.cdiv,
# tl.zeros) are compiled-mode objects whenever triton was imported before TRITON_INTERPRET=1 was set (torch._dynamo
# imports it early), and they then refuse to run inside interpreted kernels. tl.reduce with the standard combine
# functions is what tl.max / tl.sum lower to (for fp32), and the interpreter maps it onto numpy.
@triton.jit
def _row_max(x):
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _row_sum(x):
    return tl.reduce(x, 1, tl.standard._sum_combine)


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def _tanh(x):
    # exp-based so it runs the same compiled and interpreted (no libdevice); no overflow for large |x|
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _e4m3_bits(x):
    """fp32 `x`, already clamped to [-FP8_MAX, FP8_MAX] -> its float8_e4m3fn bit pattern (int32, 0..255), rounded
    to nearest even with integer ops only: bit for bit torch's cast, wherever it runs."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # |x| >= 2^-6 (normal e4m3): keep 3 of fp32's 23 mantissa bits, ties to even; a carry rounds up the exponent,
    # then rebias the exponent from 127 to 7 (120 << 3). |x| <= 448 never reaches the NaN code 0x7F.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # |x| < 2^-6 (subnormal e4m3): the integer nearest |x| * 2^9 = full * 2^(exp - 141), ties to even
    # (m = 8 is the smallest normal, 0x08, so rounding up across the boundary needs no special case)
    exp = mag >> 23
    full = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exp, 25)  # from 25 on, everything below 2^-10 rounds to 0
    m = full >> shift
    rem = full - (m << shift)
    half = 1 << (shift - 1)
    m = m + ((rem > half) | ((rem == half) & ((m & 1) == 1))).to(tl.int32)
    return sign | tl.where(mag >= 0x3C800000, normal, m)  # 0x3C800000: 2^-6 in fp32


@triton.jit
def _to_cache(x, scale, cache_ptr, FP8: tl.constexpr, SOFT_FP8: tl.constexpr):
    """New K or V values in the cache's element type. FP8: x / scale (IEEE division, as torch does it), saturated
    to +-FP8_MAX, rounded to nearest even (compiled: cvt.rn.satfinite; interpreted: `_e4m3_bits`)."""
    if FP8:
        y = tl.div_rn(x.to(tl.float32), scale)  # bf16 -> fp32 is exact in the interpreter too
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        if SOFT_FP8:
            out = _e4m3_bits(y).to(tl.uint8).to(cache_ptr.dtype.element_ty, bitcast=True)
        else:
            out = y.to(cache_ptr.dtype.element_ty)
    else:
        out = x.to(cache_ptr.dtype.element_ty)
    return out


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, alibi_ptr,
    num_seqs, scale, v_scale, softcap, window, chunk, log2_block_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, HEADS_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """One program: (query tile of one sequence, KV head, KV split). Its BLOCK_M rows are BLOCK_Q query tokens
    x HEADS_PER_KV query heads of the KV head's GQA group (row r: token r // HEADS_PER_KV, head r % HEADS_PER_KV),
    so each K/V tile is read once for the whole group. KV positions are walked TILE_N at a time through the
    block table with an online softmax in fp32. SPLIT: write this split's (max, sum, unnormalised out) for
    `reduce_splits_kernel` instead of the output. fp8 caches: `scale` already includes k_scale; `v_scale`
    multiplies the accumulator (1.0 for unquantized caches: exact). Layer extras (attention/extras.py): `chunk`
    (NO_CHUNK: none) limits keys to the query's chunk; HAS_ALIBI adds alibi_ptr[head] * (k - q) to the scores;
    HAS_SINKS joins sinks_ptr[head] to the softmax denominator, once per row (split 0 adds it to its partial state,
    which the reduce then merges like any other)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    tile_start = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= q_len:
        return
    context = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // HEADS_PER_KV
    head = kv_head * HEADS_PER_KV + rows % HEADS_PER_KV
    row_valid = (rows < BLOCK_Q * HEADS_PER_KV) & (tok < q_len)
    q_pos = context - q_len + tok  # bottom-right aligned causal positions
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM
    row_index = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + row_index[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:  # interpreter only: bf16 / fp8 are carried as raw bits there (module docstring): compute in fp32
        q = q.to(tl.float32)

    # keys this tile can see: [first query's position - window + 1 (or its chunk's start), last query's position];
    # other tiles skipped
    last_tok = tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    first_pos = context - q_len + tile_start
    kv_lo = tl.maximum(tl.maximum(first_pos - window + 1, 0), (first_pos // chunk) * chunk)
    kv_hi = context - q_len + last_tok + 1
    tile_lo = kv_lo // TILE_N
    tile_hi = _cdiv(kv_hi, TILE_N)
    if SPLIT:
        per_split = _cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    block_mask = (1 << log2_block_size) - 1
    if USE_SOFTCAP:
        qk_scale = scale / softcap
    else:
        qk_scale = scale * 1.4426950408889634
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
    chunk_lo = (q_pos // chunk) * chunk
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE_N + tl.arange(0, TILE_N)
        k_valid = k_pos < kv_hi
        block = tl.load(table_row + (k_pos >> log2_block_size), mask=k_valid, other=0).to(tl.int64)
        offset = k_pos & block_mask
        k_off = block * stride_kb + offset * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + offset * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_off[None, :] + dims[:, None], mask=k_valid[None, :] & dim_valid[:, None],
                    other=0.0)  # [HEAD_PAD, TILE_N]
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=k_valid[:, None] & dim_valid[None, :],
                    other=0.0)  # [TILE_N, HEAD_PAD]
        # into the queries' dtype: fp8 -> fp16 / bf16 / fp32 is exact, unquantized caches already are (a no-op);
        # under UPCAST q is fp32, so this is the interpreter's exact upcast of bf16 / fp8 bits
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if USE_SOFTCAP:  # s = cap * tanh(s * scale / cap), then into log2 units
            s = _tanh(s * qk_scale) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        if HAS_ALIBI:  # in log2 units, like s
            s = s + slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window) & k_valid[None, :]
        allowed = allowed & (k_pos[None, :] >= chunk_lo[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(s))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + _row_sum(p)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS:
        if split == 0:  # the sink joins the denominator once: m, l and acc rescaled to the new running max
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new
    acc = acc * v_scale  # the V dequantization, once per program (and before the splits are combined)
    if SPLIT:
        part = (row_index * (tl.num_programs(1) * HEADS_PER_KV) + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_valid[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows may have seen no key at all
        tl.store(out_ptr + row_index[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def reduce_splits_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_splits, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """One program per (token, head): combine the splits' partial softmax states (log2 units)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (row * tl.num_programs(1) + head) * num_splits
    dims = tl.arange(0, HEAD_PAD)
    m_run = tl.load(part_m_ptr + base)
    l_run = tl.load(part_l_ptr + base)
    acc = tl.load(part_acc_ptr + base * HEAD_PAD + dims)
    for s in range(1, num_splits):
        m_s = tl.load(part_m_ptr + base + s)
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        beta = tl.exp2(m_s - m_new)
        l_run = l_run * alpha + tl.load(part_l_ptr + base + s) * beta
        acc = acc * alpha + tl.load(part_acc_ptr + (base + s) * HEAD_PAD + dims) * beta
        m_run = m_new
    out = acc / l_run
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def store_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, num_kv_heads,
                    log2_block_size, k_scale, v_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ckb, stride_cks, stride_ckh, stride_cvb, stride_cvs, stride_cvh,
                    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
                    SOFT_FP8: tl.constexpr):
    """One program per (token, group of BLOCK_H KV heads): new K/V row -> its cache slot. Negative slots
    (padding) are skipped. Values are cast to the cache dtype (FP8: quantized with k_scale / v_scale, `_to_cache`)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot >> log2_block_size
    offset = slot & ((1 << log2_block_size) - 1)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + block * stride_ckb + offset * stride_cks + heads[:, None] * stride_ckh + dims[None, :],
             _to_cache(k, k_scale, key_cache_ptr, FP8, SOFT_FP8), mask=mask)
    tl.store(value_cache_ptr + block * stride_cvb + offset * stride_cvs + heads[:, None] * stride_cvh + dims[None, :],
             _to_cache(v, v_scale, value_cache_ptr, FP8, SOFT_FP8), mask=mask)
