"""A native CPU attention for prompts (`cpu/prefill_attention.c`), measured against torch's path.

A prefill step attends each fresh prompt over its own keys; torch's CPU flash kernel does its small products through
MKL, which on an AMD EPYC (Zen 5) runs its AVX2 code: there one layer's 64 prompts of 16-200 tokens (8 / 2 heads of
64, one thread) took 27 ms in SDPA against 12 ms in this kernel in fp32, 30 against 11 in bf16 (head dim 128: 48 /
53 against 21-22). Prompts with a sliding window shorter than themselves, attention chunks, tanh soft-capping or
attention sinks take SDPA with a mask or hf_paged's explicit-score attention (`torch_backend._explicit`), slower
still: there, 400-token prompts, gemma2-like soft-capping (8 / 4 heads of 256) 17-18 ms against 5.2-5.4, gpt-oss-like
sinks with a 128-token window (64 / 8 heads of 64) 120 ms against 7. Prompts whose new tokens follow keys already in
the pages (a prefix hit, a later chunk of a long prompt) take the same kernel, once per sequence, over keys read from
their pages (`attend_from_pages`), against torch's padded tile of them. Another CPU may rank them otherwise, so
nothing is assumed:

Invariants:
- Only for what the kernel implements: causal attention of a prompt's new tokens over the keys before them and
  their own (bottom-right), optionally within a sliding window and / or attention chunks, with tanh soft-capping
  and / or per-head sinks (finite; as `LayerExtras` defines them), no ALiBi or relative logits (the caller checks);
  fp32 or bf16 CPU tensors (and pages) of one dtype, head dim 64, 80, 96, 128 or 256, query heads a multiple of the
  key/value heads, no gradient wanted. Anything else is torch's path.
- Chosen per (dtype, heads, kv heads, head dim, key-count bucket (a power of two; a tile's: its longest), torch
  threads, which of window / chunk (where shorter than the keys), soft-cap, sinks and cached keys it has; a tile of
  prompts with cached keys is one call): until chosen, the calls of a key take torch's path and the kernel in turn,
  each call timed (`trials`: a warm-up each, a far slower candidate out after one counted call, then the medians of
  5); torch's path stays unless the kernel measured more than 5 % faster. The kernel spreads its 16-row query blocks
  over torch's threads (`torch.get_num_threads()`, the same OpenMP pool).
- The same attention as torch's in another order of the sums, with an exp within 3e-7 relative (measured over
  [-87, 0]) and a tanh within 1e-7 absolute (measured over [-40, 40]).
- `HF_PAGED_CPU_PREFILL=0`: never (not built); `=kernel` forces it wherever it may run (tests); `prefill_choices()`
  lists what was chosen.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
from pathlib import Path

import torch

from .. import native, trials

SOURCE = Path(__file__).with_name("cpu") / "prefill_attention.c"
SWITCH = "HF_PAGED_CPU_PREFILL"
BASELINE = "torch"  # SDPA, or the explicit scores
HEAD_DIMS = (64, 80, 96, 128, 256)
EXTRAS = frozenset({"chunked", "sinks"})  # the `LayerExtras` the kernel implements (with windows and soft-caps)
TABLE = trials.Table(BASELINE)


class PrefillKernel:
    def __init__(self, path: Path):
        fn = ctypes.CDLL(str(path)).prefill_attend
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr] * 4 + [i64] * 4 + [ctypes.c_float, ctypes.c_int, ptr, ctypes.c_int, i64, i64,
                                                ctypes.c_float, ptr, i64]
        fn.restype = ctypes.c_int
        self.fn = fn

    @torch.compiler.disable  # native code through raw pointers: never traced
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                 window: int | None = None, chunk: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [L, H, D] at positions K - L .. K - 1, key / value [K, G, D] (K >= L: the keys before the queries,
        then theirs) -> [L, H, D]; `sinks` [H] (`takes` checked by the caller)."""
        query, key, value = (t if t.is_contiguous() else t.contiguous() for t in (query, key, value))
        length, heads, head_dim = query.shape
        padded, threads = -(-key.shape[0] // 16) * 16, torch.get_num_threads()
        scratch = torch.empty(2 * head_dim * padded + threads * 16 * (head_dim + padded), dtype=torch.float32)
        sinks = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
        out = torch.empty_like(query)
        status = self.fn(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), length, heads,
                         key.shape[1], head_dim, scale, int(query.dtype is torch.bfloat16), scratch.data_ptr(), threads,
                         window or 0, chunk or 0, softcap or 0.0, None if sinks is None else sinks.data_ptr(),
                         key.shape[0] - length)
        if status != 0:  # pragma: no cover - `takes` lets only what the kernel runs through
            raise ValueError(f"prefill kernel refused q {tuple(query.shape)}, k {tuple(key.shape)}")
        return out


@functools.lru_cache(maxsize=1)
def load_prefill_kernel() -> PrefillKernel | None:
    kernel, _ = native.load(SOURCE, SWITCH, PrefillKernel)
    return kernel


def _fits(query: torch.Tensor, keys: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None) -> bool:
    """What the kernel implements (module invariants) for queries [T, H, D] and keys or pages [..., G, D]."""
    return (query.dtype in (torch.float32, torch.bfloat16) and keys.dtype is query.dtype and query.is_cpu
            and keys.is_cpu and query.dim() == 3 and query.shape[2] in HEAD_DIMS and keys.shape[-1] == query.shape[2]
            and keys.shape[-2] > 0 and query.shape[1] % keys.shape[-2] == 0 and query.shape[0] > 0
            and (not softcap or (softcap > 0 and math.isfinite(softcap)))
            and (sinks is None or (sinks.is_cpu and sinks.numel() == query.shape[1] and bool(sinks.isfinite().all())))
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                     for t in (query, keys, sinks))))


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, softcap: float | None = None,
          sinks: torch.Tensor | None = None) -> bool:
    """Whether the kernel runs `query` [L, H, D] over `key` / `value` [K >= L, G, D] (the last L keys its own)."""
    return (_fits(query, key, softcap, sinks) and value.dtype is key.dtype and value.is_cpu and key.dim() == 3
            and key.shape == value.shape and key.shape[0] >= query.shape[0]
            and not (torch.is_grad_enabled() and value.requires_grad))


def _limits(keys: int, window: int | None, chunk: int | None, softcap: float | None, sinks: torch.Tensor | None,
            context: bool) -> str:
    """What limits the keys or changes the scores, for a choice's key (prefill_choices)."""
    return "".join(name for name, on in (("w", window and window < keys), ("c", chunk and chunk < keys),
                                         ("s", softcap), ("k", sinks is not None), ("x", context)) if on)


def _measured(choice_key: tuple, kernel_path, torch_path) -> torch.Tensor:
    """`torch_path()` or `kernel_path()`, whichever `choice_key` chose or its trial names now (timed)."""
    name = None if choice_key in TABLE.choices else TABLE.next_call(choice_key, dict.fromkeys((BASELINE, "kernel")))
    path = name or TABLE.choices[choice_key].path
    out, _ = TABLE.timed(choice_key, name, kernel_path if path == "kernel" else torch_path)
    return out


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, torch_path,
           window: int | None = None, chunk: int | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One prompt's causal attention, fresh or after key.shape[0] - query.shape[0] cached keys (module invariants):
    `torch_path()` or the kernel, whichever this key chose or its trial names now (timed)."""
    switch = os.environ.get(SWITCH, "").strip().lower()
    if switch == "0" or not takes(query, key, value, softcap, sinks):
        return torch_path()
    kernel = load_prefill_kernel()
    if kernel is None:
        return torch_path()
    run = functools.partial(kernel, query, key, value, scale, window, chunk, softcap, sinks)
    if switch == "kernel":
        return run()
    length = key.shape[0]
    choice_key = (query.dtype, query.shape[1], key.shape[1], query.shape[2], 1 << max(length - 1, 0).bit_length(),
                  torch.get_num_threads(), _limits(length, window, chunk, softcap, sinks, length > query.shape[0]))
    return _measured(choice_key, run, torch_path)


def attend_from_pages(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, sequences,
                      most: int, scale: float, torch_path, window: int | None = None, chunk: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prompts whose new tokens follow keys already in the pages (a prefix hit, a later chunk), read from the pages
    [blocks, block size, G, D]: `sequences()` gives each one's (packed query rows, its blocks, its keys in all, the
    cached and its own), asked only when the kernel runs; `most`: the largest of those key counts. `torch_path()`
    (the whole tile) or the kernel once per sequence, whichever this key chose or its trial names now (timed); the
    rows come back in `sequences`' order."""
    switch = os.environ.get(SWITCH, "").strip().lower()
    kernel = load_prefill_kernel() if switch != "0" and _fits(query, key_cache, softcap, sinks) else None
    if kernel is None or key_cache.dim() != 4 or value_cache.shape != key_cache.shape \
            or value_cache.dtype is not key_cache.dtype or most <= 0:
        return torch_path()

    def run() -> torch.Tensor:
        outs = []
        for rows, blocks, keys in sequences():
            k, v = (cache[blocks].flatten(0, 1)[:keys] for cache in (key_cache, value_cache))
            outs.append(kernel(query[rows], k, v, scale, window, chunk, softcap, sinks))
        return torch.cat(outs)

    if switch == "kernel":
        return run()
    choice_key = (query.dtype, query.shape[1], key_cache.shape[2], query.shape[2], 1 << max(most - 1, 0).bit_length(),
                  torch.get_num_threads(), _limits(most, window, chunk, softcap, sinks, True))
    return _measured(choice_key, run, torch_path)


def prefill_choices() -> list[dict]:
    """Every choice so far: shape, key-count bucket, what limits the keys or changes the scores (w: a window shorter
    than the keys, c: chunks, s: soft-cap, k: sinks, x: keys cached before the queries), path, each candidate's time
    in us."""
    return [{"dtype": str(k[0]).replace("torch.", ""), "heads": k[1], "kv_heads": k[2], "head_dim": k[3],
             "rows": k[4], "threads": k[5], "limits": k[6], "path": c.path,
             "us": {n: round(s * 1e6, 1) for n, s in c.seconds.items()}} for k, c in list(TABLE.choices.items())]
