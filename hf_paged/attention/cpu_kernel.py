"""A native CPU decode kernel (`cpu/paged_decode.c`), built on first use with the system C compiler.

Decodes read K/V straight from the pages (no gather copy) and each K/V row once per GQA group; sliding windows,
soft-capping, ALiBi, attention sinks and attention chunks are implemented in the kernel. The work is
split over OpenMP threads of the same libgomp torch uses (one pool, no oversubscription). Without a
compiler the kernel is simply absent (`load_cpu_kernel()` returns None and `cpu_kernel_status()` says why)
and the pure-torch path is used. Where it loads, which of torch's path and the kernel's two paths a layer shape takes
is timed on the engine's decode steps (`decode_choice`).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .. import native
from .extras import LayerExtras

SOURCE = Path(__file__).with_name("cpu") / "paged_decode.c"
_status: dict[str, str] = {}


class CpuDecodeKernel:
    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self.fns = {torch.float32: library.paged_decode_f32, torch.bfloat16: library.paged_decode_bf16}
        for fn in self.fns.values():
            fn.argtypes = [ptr] * 7 + [i64] * 6 + [f32, i64, f32, ptr, ptr, i64, ptr, i64, i64, i64, i64]
            fn.restype = None

    @torch.compiler.disable  # never traced: dynamo tracing a compiled model into this ctypes call corrupted the heap
    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 softcap: float | None, extras: LayerExtras | None = None,
                 key_mask: torch.Tensor | None = None, path: int = 0) -> torch.Tensor:
        """query [G, H, D] in the pages' dtype (one token per sequence) -> [G, H, D]; tables int64 [G, B], context_lens
        int64 [G].
        `extras`: the layer's sinks / ALiBi slopes / attention chunk (LayerExtras), all implemented here.
        `key_mask`: bool [G, >= max context], False for keys to leave out (a row with none left gets zeros).
        `path`: 0 by dtype (bf16 pages the vector path), 1 per key, 2 the vector path where head_dim % 16 == 0
        (decode_choice measures which)."""
        dtype = query.dtype  # fp32 or bf16 (the pages' dtype): the kernel computes in fp32
        if dtype != torch.float32:
            query = query.to(torch.float32)
        if not query.is_contiguous():  # the packed rows may come as a transposed view of [H, T, D]
            query = query.contiguous()
        groups, num_heads, head_dim = query.shape
        max_blocks = block_tables.shape[1]
        max_context = max_blocks * key_cache.shape[1]
        out = torch.empty_like(query)
        scores = torch.empty(groups * num_heads * max_context, dtype=torch.float32)
        slopes = sinks = None
        chunk = 0
        if extras is not None:
            slopes, sinks = (_per_head(t, num_heads) for t in (extras.alibi_slopes, extras.sinks))
            chunk = extras.chunk_size or 0
        mask = None
        if key_mask is not None:
            if key_mask.shape[0] != groups or key_mask.shape[1] < int(context_lens.max()):
                raise ValueError(f"key_mask of shape {tuple(key_mask.shape)} does not cover {groups} sequences' keys")
            mask = key_mask.to(device="cpu", dtype=torch.uint8).contiguous()
        self.fns[key_cache.dtype](query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                  block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), scores.data_ptr(),
                                  num_heads, key_cache.shape[2], head_dim, key_cache.shape[1], max_blocks, max_context,
                                  scale, sliding_window or 0, softcap or 0.0,
                                  0 if slopes is None else slopes.data_ptr(), 0 if sinks is None else sinks.data_ptr(),
                                  chunk, 0 if mask is None else mask.data_ptr(), 0 if mask is None else mask.shape[1], 0,
                                  groups, path)
        return out if dtype == torch.float32 else out.to(dtype)


def _per_head(values: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """A per-head vector ([H] sinks or slopes) as the kernel reads it: contiguous float32 on the CPU."""
    if values is None:
        return None
    values = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if values.shape != (num_heads,):
        raise ValueError(f"per-head attention values must have shape [{num_heads}], not {tuple(values.shape)}")
    return values


@functools.lru_cache(maxsize=1)
def load_cpu_kernel() -> CpuDecodeKernel | None:
    kernel, _status["reason"] = native.load(SOURCE, "HF_PAGED_CPU_KERNEL", CpuDecodeKernel)
    return kernel


def cpu_kernel_status() -> str:
    """Why the native CPU decode kernel is or is not in use."""
    load_cpu_kernel()
    return _status.get("reason", "not tried")


def usable(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """fp32 or bf16 pages (the query in the same dtype), contiguous, head dim up to 256, on the CPU."""
    return (query.device.type == "cpu" and key_cache.dtype in (torch.float32, torch.bfloat16)
            and query.dtype == key_cache.dtype and key_cache.is_contiguous() and query.shape[-1] <= 256)
