"""A native CPU causal attention for fresh prompts (`cpu/prefill_attention.c`), measured against torch's SDPA.

A prefill step attends each fresh prompt over its own keys; torch's CPU flash kernel does its small products through
MKL, which on an AMD EPYC (Zen 5) runs its AVX2 code: there one layer's 38 prompts of 16-200 tokens (8 / 2 heads of
64) took 17-19 ms in SDPA against 10-11 ms in this kernel, fp32 and bf16 alike (head dim 128: 30-32 against 16-17).
Another CPU may rank them otherwise, so nothing is assumed:

Invariants:
- Only for what the kernel implements: plain causal attention of a prompt with nothing cached (no window, soft-cap,
  sinks, ALiBi or chunks: the caller checks), fp32 or bf16 CPU tensors of one dtype, head dim 64 or 128, query heads
  a multiple of the key/value heads, no gradient wanted. Anything else is SDPA, as before.
- Chosen per (dtype, heads, kv heads, head dim, prompt-length bucket (a power of two), torch threads): until chosen,
  the calls of a key take SDPA and the kernel in turn, each call timed (`trials`: a warm-up each, a far slower
  candidate out after one counted call, then the medians of 5); SDPA stays unless the kernel measured more than 5 %
  faster. It spreads its 16-row query blocks over torch's threads
  (`torch.get_num_threads()`, the same OpenMP pool).
- The same attention as SDPA's in another order of the sums, with an exp within 3e-7 relative (measured over [-87, 0]).
- `HF_PAGED_CPU_PREFILL=0`: never (not built); `=kernel` forces it wherever it may run (tests); `prefill_choices()`
  lists what was chosen.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from .. import native, trials

SOURCE = Path(__file__).with_name("cpu") / "prefill_attention.c"
SWITCH = "HF_PAGED_CPU_PREFILL"
BASELINE = "torch"  # SDPA
HEAD_DIMS = (64, 128)
TABLE = trials.Table(BASELINE)


class PrefillKernel:
    def __init__(self, path: Path):
        fn = ctypes.CDLL(str(path)).prefill_attend
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr] * 4 + [i64] * 4 + [ctypes.c_float, ctypes.c_int, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn

    @torch.compiler.disable  # native code through raw pointers: never traced
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """query [L, H, D], key / value [L, G, D] -> [L, H, D] (`takes` checked by the caller)."""
        query, key, value = (t if t.is_contiguous() else t.contiguous() for t in (query, key, value))
        length, heads, head_dim = query.shape
        padded, threads = -(-length // 16) * 16, torch.get_num_threads()
        scratch = torch.empty(2 * head_dim * padded + threads * 16 * (head_dim + padded), dtype=torch.float32)
        out = torch.empty_like(query)
        status = self.fn(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), length, heads,
                         key.shape[1], head_dim, scale, int(query.dtype is torch.bfloat16), scratch.data_ptr(), threads)
        if status != 0:  # pragma: no cover - `takes` lets only what the kernel runs through
            raise ValueError(f"prefill kernel refused q {tuple(query.shape)}, k {tuple(key.shape)}")
        return out


@functools.lru_cache(maxsize=1)
def load_prefill_kernel() -> PrefillKernel | None:
    kernel, _ = native.load(SOURCE, SWITCH, PrefillKernel)
    return kernel


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return (query.dtype in (torch.float32, torch.bfloat16) and key.dtype is query.dtype and value.dtype is query.dtype
            and query.is_cpu and key.is_cpu and value.is_cpu and query.dim() == 3 and query.shape[2] in HEAD_DIMS
            and key.shape == value.shape and key.shape[0] == query.shape[0] and key.shape[2] == query.shape[2]
            and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0 and query.shape[0] > 0
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, sdpa) -> torch.Tensor:
    """One fresh prompt's causal attention: `sdpa()` (torch's) or the kernel, whichever this key chose or its trial
    names now (timed)."""
    switch = os.environ.get(SWITCH, "").strip().lower()
    if switch == "0" or not takes(query, key, value):
        return sdpa()
    kernel = load_prefill_kernel()
    if kernel is None:
        return sdpa()
    if switch == "kernel":
        return kernel(query, key, value, scale)
    length = query.shape[0]
    bucket = 1 << max(length - 1, 0).bit_length()
    choice_key = (query.dtype, query.shape[1], key.shape[1], query.shape[2], bucket, torch.get_num_threads())
    choice = TABLE.choices.get(choice_key)
    name = TABLE.next_call(choice_key, dict.fromkeys((BASELINE, "kernel"))) if choice is None else None
    path = name or TABLE.choices[choice_key].path
    out, _ = TABLE.timed(choice_key, name, lambda: kernel(query, key, value, scale) if path == "kernel" else sdpa())
    return out


def prefill_choices() -> list[dict]:
    """Every choice so far: shape, length bucket, path, each candidate's time in us."""
    return [{"dtype": str(k[0]).replace("torch.", ""), "heads": k[1], "kv_heads": k[2], "head_dim": k[3],
             "rows": k[4], "threads": k[5], "path": c.path, "us": {n: round(s * 1e6, 1) for n, s in c.seconds.items()}}
            for k, c in list(TABLE.choices.items())]
