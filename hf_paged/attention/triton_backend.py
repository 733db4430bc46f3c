"""Triton paged attention: kernel variants, the split-KV rule and the launcher (`paged_attention`) behind the `triton`
backend (attention/backends/triton_varlen.py, which holds its support rules).

One unified varlen kernel serves decodes, fresh prompts and chunked prefills in a single launch: a program is
(query tile of one sequence, KV head[, KV split]); its rows pack the query tokens x query heads of that KV head's
GQA group, so each K/V tile is read once per group. Decode-only batches with long contexts and too few
(sequence, KV head) programs to fill the GPU split each sequence's KV range over several programs, and a small
second kernel combines their partial softmax states. Also `triton_store_kv`, the cache write as one kernel (the
engine stores with torch's `store_kv`; this one is kept for its byte-exact fp8 quantization, tested against it).
FP8 (float8_e4m3fn) caches with per-layer (k_scale, v_scale) are read and written by the same kernels.

Kernels live in triton_kernels.py; they are interpreter functions when TRITON_INTERPRET=1 was set before that
module was first imported (then this backend runs on CPU tensors, slowly: for tests).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch

from .extras import LayerExtras
from .metadata import AttentionMetadata

try:
    import triton

    from . import triton_kernels as kernels
    IMPORT_ERROR = None
except ImportError as e:  # optional dependency: the backend reports itself unavailable
    triton = kernels = None
    IMPORT_ERROR = f"triton is not installed ({e}); pip install 'hf_paged[triton]'"

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
FP8 = torch.float8_e4m3fn  # the scaled fp8 cache dtype (torch_backend.quantize); triton calls it fp8e4nv
KV_DTYPES = {**DTYPES, FP8: "fp8e4nv"}
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
MAX_HEADS_PER_KV = 128
NO_WINDOW = 1 << 30
NO_CHUNK = 1 << 30  # one chunk holds every position: no limit
# split-KV rule: decode-only steps whose (sequences x KV heads) programs would not fill 2 waves of SMs are split
# so that every split still walks at least SPLIT_MIN_KEYS keys; at most MAX_SPLITS splits.
SPLIT_MIN_KEYS = 256
MAX_SPLITS = 32
SPLIT_WAVES = 2


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreted() -> bool:
    """Whether the kernels were defined as interpreter functions (TRITON_INTERPRET=1 at their import)."""
    return kernels is not None and not isinstance(kernels.paged_attention_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class KernelConfig:
    """Everything that selects one compiled variant of `paged_attention_kernel`, plus its launch options."""

    dtype: str  # "fp16" | "bf16" | "fp32": queries and output
    kv_dtype: str  # the caches: `dtype`, or "fp8e4nv" (scaled fp8)
    head_dim: int
    heads_per_kv: int
    block_m: int  # rows per program: block_q tokens x heads_per_kv heads (+ padding to a power of two)
    tile_n: int  # KV positions per inner step
    softcap: bool
    split: bool
    num_warps: int
    num_stages: int
    sinks: bool = False  # layer extras compiled in (attention/extras.py); attention chunks are a runtime argument
    alibi: bool = False

    @property
    def head_pad(self) -> int:
        return _pow2(self.head_dim)

    @property
    def block_q(self) -> int:
        return self.block_m // self.heads_per_kv

    def constexprs(self, upcast: bool = False) -> dict:
        return {"HEAD_DIM": self.head_dim, "HEAD_PAD": self.head_pad, "HEADS_PER_KV": self.heads_per_kv,
                "BLOCK_M": self.block_m, "BLOCK_Q": self.block_q, "TILE_N": self.tile_n,
                "USE_SOFTCAP": self.softcap, "SPLIT": self.split, "UPCAST": upcast,
                "DOT_PRECISION": "ieee" if self.dtype == "fp32" else "tf32", "HAS_SINKS": self.sinks,
                "HAS_ALIBI": self.alibi}


def choose_config(dtype: str, head_dim: int, heads_per_kv: int, decode_only: bool, softcap: bool,
                  split: bool, kv_dtype: str | None = None) -> KernelConfig:
    """Decodes: 16-row tiles (a decode has one token, so rows are mostly the GQA group). Prefill: 64-row tiles.
    Narrower KV tiles and more warps for 256-wide heads. fp32 (exact "ieee" dots, done with FMAs) spills with
    those tiles on sm_90, so it takes 32-row prefill tiles, 16-key steps and 2 stages (measured: no spills).
    fp8 caches (`kv_dtype` "fp8e4nv"; tiles are upcast to the query dtype after loading) take their query dtype's
    tiles except: fp32 runs unpipelined (with 2 stages the upcast between the async copy and the FMA dot spills
    0.2-5 KB on sm_90) and half-precision decodes take half-width KV steps (full-width, ~1 in 10 spilled 8-32 bytes
    at ptxas's 168-register cap). Then 13 of the 742 fp8 variants (and 4 of the 742 unquantized ones) keep an 8-16
    byte frame (in the one inspected: one value parked across the main loop, stored before it, loaded after).
    Compile-checked only: not yet timed on a GPU."""
    kv_dtype = kv_dtype or dtype
    fp8 = kv_dtype != dtype
    head_pad = _pow2(max(head_dim, MIN_HEAD_DIM))
    if dtype == "fp32":
        block_m = max(16 if decode_only else 32, _pow2(heads_per_kv))
        return KernelConfig(dtype, kv_dtype, head_dim, heads_per_kv, block_m, 16, softcap, split,
                            4 if block_m == 16 else 8, 1 if fp8 else 2)
    block_m = max(16 if decode_only else 64, _pow2(heads_per_kv))
    tile_n = (64 if head_pad <= 128 else 32) // (2 if fp8 and decode_only else 1)
    num_warps = 8 if block_m * head_pad >= 64 * 256 else 4
    num_stages = 3
    return KernelConfig(dtype, kv_dtype, head_dim, heads_per_kv, block_m, tile_n, softcap, split, num_warps,
                        num_stages)


def kernel_configs(head_dims=(16, 32, 64, 80, 96, 128, 256), heads_per_kv=(1, 2, 4, 8, 16, 32)):
    """Every variant the dispatcher can pick for these head dims and GQA ratios, each with an unquantized and an
    fp8 cache, without layer extras and with sinks or ALiBi (block size, sequence lengths, window, attention chunk,
    scales and split count are runtime arguments; they never select a variant)."""
    configs = []
    for dtype, fp8, head_dim, per_kv, softcap, mode, extras in itertools.product(
            ("fp16", "bf16", "fp32"), (False, True), head_dims, heads_per_kv, (False, True),
            ("prefill", "decode", "split"), ((False, False), (True, False), (False, True))):
        cfg = choose_config(dtype, head_dim, per_kv, mode != "prefill", softcap, mode == "split",
                            "fp8e4nv" if fp8 else dtype)
        configs.append(dataclasses.replace(cfg, sinks=extras[0], alibi=extras[1]))
    return list(dict.fromkeys(configs))


def kernel_signature(cfg: KernelConfig):
    """(signature, constexprs, attrs) of `paged_attention_kernel` for `cfg` as the launcher specialises it
    (pointers and head-dim multiples 16-byte aligned), for ahead-of-time compiles (triton.compile(ASTSource))."""
    fn = kernels.paged_attention_kernel
    names = fn.arg_names
    constexprs = cfg.constexprs()
    pointers = {"out_ptr": cfg.dtype, "q_ptr": cfg.dtype, "k_cache_ptr": cfg.kv_dtype, "v_cache_ptr": cfg.kv_dtype,
                "block_tables_ptr": "i32", "cu_seqlens_q_ptr": "i32", "context_lens_ptr": "i32",
                "part_m_ptr": "fp32", "part_l_ptr": "fp32", "part_acc_ptr": "fp32", "sinks_ptr": "fp32",
                "alibi_ptr": "fp32"}
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        elif name in ("scale", "v_scale", "softcap"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    aligned = [n for n in names if n in pointers or (n.startswith("stride_") and n != "stride_bt" and
                                                     cfg.head_dim % 16 == 0)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return signature, constexprs, attrs


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_count(num_seqs: int, num_kv_heads: int, max_query_len: int, max_context_len: int, sm_count: int,
                sliding_window: int | None = None) -> int:
    """Split-KV rule: only decode-only steps; splits fill SPLIT_WAVES waves of SMs with (sequence, KV head,
    split) programs, each split keeping >= SPLIT_MIN_KEYS keys (of the window, if one applies)."""
    keys = min(max_context_len, sliding_window) if sliding_window else max_context_len
    programs = num_seqs * num_kv_heads
    if max_query_len != 1 or keys < 2 * SPLIT_MIN_KEYS or programs >= SPLIT_WAVES * sm_count:
        return 1
    return max(1, min(-(-SPLIT_WAVES * sm_count // programs), keys // SPLIT_MIN_KEYS, MAX_SPLITS))


@functools.cache
def _dummy(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                    softcap: float | None = None, num_splits: int | None = None,
                    kv_scales: tuple[float, float] = (1.0, 1.0), extras: LayerExtras | None = None) -> torch.Tensor:
    """query [T, H, D] -> output [T, H, D] (new K/V already stored). `num_splits` overrides the split-KV rule.
    `kv_scales`: (k_scale, v_scale) of float8_e4m3fn caches (stored = value / scale); ignored for other caches,
    as `torch_backend.dequantize` ignores them. `extras`: the layer's sinks / ALiBi slopes / attention chunk."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    if value_cache.stride() != key_cache.stride() or value_cache.dtype != key_cache.dtype:
        raise ValueError("triton backend needs key and value caches of one layout and dtype")
    num_seqs = metadata.context_lens.shape[0]
    if num_splits is None:
        sms = _sm_count(query.device.index or 0) if query.is_cuda else 132
        num_splits = split_count(num_seqs, num_kv_heads, metadata.max_query_len, metadata.max_context_len, sms,
                                 sliding_window)
    cfg = choose_config(DTYPES[query.dtype], head_dim, num_heads // num_kv_heads, metadata.max_query_len == 1,
                        bool(softcap), num_splits > 1, KV_DTYPES[key_cache.dtype])
    sinks, alibi, chunk = _extras_arguments(extras, num_heads, query.device)
    cfg = dataclasses.replace(cfg, sinks=sinks is not None, alibi=alibi is not None)
    fp8 = key_cache.dtype == FP8
    k_scale, v_scale = (float(kv_scales[0]), float(kv_scales[1])) if fp8 else (1.0, 1.0)
    # numpy has neither bfloat16 nor fp8 (the interpreter carries raw bits), so interpreted kernels upcast to fp32
    upcast = interpreted() and (query.dtype == torch.bfloat16 or fp8)
    if cfg.split:
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_splits, cfg.head_pad, dtype=torch.float32,
                               device=query.device)
    else:
        part_m = part_l = part_acc = _dummy(query.device)
    tables = metadata.block_tables.contiguous()
    window = sliding_window if sliding_window else NO_WINDOW
    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads, num_splits)
    kernels.paged_attention_kernel[grid](
        out, query, key_cache, value_cache, tables, metadata.cu_seqlens_q, metadata.context_lens,
        part_m, part_l, part_acc, _dummy(query.device) if sinks is None else sinks,
        _dummy(query.device) if alibi is None else alibi,
        num_seqs, float(scale) * k_scale, v_scale, float(softcap or 0.0), int(window), chunk,
        block_size.bit_length() - 1,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), tables.stride(0),
        **cfg.constexprs(upcast), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split:
        kernels.reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=cfg.head_pad, num_warps=4 if cfg.head_pad >= 256 else 2)
    return out


def _extras_arguments(extras: LayerExtras | None, num_heads: int, device: torch.device):
    """(sinks, alibi slopes, chunk) as the kernel reads them: [H] fp32 on the queries' device or None; the chunk,
    NO_CHUNK when there is none."""
    def per_head(values):
        if values is None:
            return None
        if values.shape != (num_heads,):
            raise ValueError(f"per-head attention values must have shape [{num_heads}], not {tuple(values.shape)}")
        return values.detach().to(device=device, dtype=torch.float32).contiguous()

    if extras is None:
        return None, None, NO_CHUNK
    return per_head(extras.sinks), per_head(extras.alibi_slopes), int(extras.chunk_size or NO_CHUNK)


def triton_store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`store_kv` as one kernel: new K/V [T, H_kv, D] (any dtype, head dim contiguous) into flat slots of the
    [num_blocks, block_size, H_kv, D] caches (cast to the cache dtype; float8_e4m3fn caches get value / scale,
    saturated to +-448 and rounded to nearest even: `torch_backend.quantize`'s bytes). Slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    if block_size & (block_size - 1) or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("triton_store_kv needs a power-of-two block size and contiguous head dims")
    fp8 = key_cache.dtype == FP8
    if value_cache.dtype != key_cache.dtype or (key_cache.element_size() == 1 and not fp8):
        raise ValueError(f"triton_store_kv needs K and V caches of one dtype, and of the 1-byte ones only {FP8}")
    head_pad = _pow2(head_dim)
    block_h = min(_pow2(num_kv_heads), max(1, 4096 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    kernels.store_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads, block_size.bit_length() - 1,
        float(k_scale), float(v_scale), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_H=block_h, FP8=fp8, SOFT_FP8=fp8 and interpreted(), num_warps=4)
