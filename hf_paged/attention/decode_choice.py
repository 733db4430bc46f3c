"""Which CPU decode attention runs: torch's paged path, or the native kernel (`cpu/paged_decode.c`) on its per-key or
its vector path, measured on the engine's own decode steps for each layer shape, once per process.

The native kernel has two ways through a sequence's keys: one key at a time (the dot products read straight from the
pages), or sixteen keys at a time per query head with their sums folded in one shuffle tree (head dims that are a
multiple of 16). On the AMX Xeon VM of issue 27, 64 sequences, 8 / 2 heads of 64, in a step's cold caches: bf16 pages
0.76 -> 0.56 ms per layer with the vector path, fp32 pages 0.60 (per key) against 0.63 (vector): the reads bound
fp32. Warm, in a loop, the vector path wins for fp32 too: so the choice is timed where it runs, in the steps. Another
CPU may rank them otherwise, and torch's path (a gather of the pages, then SDPA) stays a candidate: nothing assumed.

Invariants:
- A choice is keyed by (dtype, query heads, kv heads, head dim, block size, torch threads). Until it is made, the
  pure decode steps' attention calls of that key take the candidates in turn, each call timed whole (`trials`: the
  rotation, a warm-up each, the early drop of a far slower one, the medians): torch's path (`BASELINE`) unless a
  native path is more than `trials.MARGIN` faster, then the least time, ties to the per-key path.
- Other calls (steps that mix prompts and decodes, HF's own loop on a `PagedCache`) take the choice when made, else
  the kernel's default by dtype (bf16 pages: the vector path), as before this choice existed.
- Every candidate computes the same attention; the paths differ in the order of the floating-point sums only.
- `HF_PAGED_CPU_DECODE=keys|vector|torch` forces a path (vector where the head dim allows, else per key), `=kernel`
  the kernel's default by dtype; unset or `auto` measures. `HF_PAGED_CPU_KERNEL=0` leaves the kernel out (torch's
  path, unmeasured).
- `decode_choices()` lists what was chosen and each candidate's time, for the benchmarks.
"""
from __future__ import annotations

import os

import torch

from .. import trials
from ..trials import Choice
from .cpu_kernel import load_cpu_kernel

PATHS = {"auto": 0, "keys": 1, "vector": 2}  # the kernel's `path` argument ("auto": by dtype)
BASELINE = "torch"
SWITCH = "HF_PAGED_CPU_DECODE"
TABLE = trials.Table(BASELINE)


def forced() -> str | None:
    value = os.environ.get(SWITCH, "auto").strip().lower()
    return value if value in ("kernel", "keys", "vector", BASELINE) else None


def candidates(head_dim: int) -> list[str]:
    """The baseline, then the per-key path, then the vector path where the head dim allows it."""
    return [BASELINE, "keys"] + (["vector"] if head_dim % 16 == 0 else [])


def key_of(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> tuple:
    return (dtype, num_heads, num_kv_heads, head_dim, block_size, torch.get_num_threads())


def pick(key: tuple, may_time: bool) -> tuple[str, bool]:
    """(path, timed) for one call of `key`: the choice where made (or forced); else, where `may_time` (a pure decode
    step), the trial's next candidate, to be timed and `TABLE.record`ed; else the kernel's default ("auto")."""
    choice = TABLE.choices.get(key)
    if choice is None:
        settled = _settled(key)
        choice = TABLE.settle(key, settled) if settled is not None else None
    if choice is not None:
        return choice.path, False
    if not may_time:
        return "auto", False
    name = TABLE.next_call(key, dict.fromkeys(candidates(key[3])))
    return (name, True) if name is not None else (TABLE.choices[key].path, False)


def _settled(key: tuple) -> Choice | None:
    """A choice made without timing: forced, or no kernel to choose."""
    wanted = forced()
    if load_cpu_kernel() is None:
        return Choice(BASELINE, {}, "no kernel")
    if wanted == "kernel":  # the kernel's own default by dtype, untimed
        return Choice("auto", {}, "forced")
    if wanted is not None:
        usable = candidates(key[3])
        return Choice(wanted if wanted in usable else "keys", {}, "forced")
    return None


def kernel_path(path: str) -> int:
    """The kernel's `path` argument for a native path name."""
    return PATHS[path]


def decode_choices() -> list[dict]:
    """Every choice so far: shape, path, each candidate's time in us, where it came from."""
    return [{"dtype": str(k[0]).replace("torch.", ""), "heads": k[1], "kv_heads": k[2], "head_dim": k[3],
             "block_size": k[4], "threads": k[5], "path": c.path, "source": c.source,
             "us": {name: round(s * 1e6, 1) for name, s in c.seconds.items()}} for k, c in list(TABLE.choices.items())]
