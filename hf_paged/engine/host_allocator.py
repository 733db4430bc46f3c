"""Keep the host allocator from handing big activation buffers back to the OS between layers (CPU engines).

With glibc's defaults, a buffer of more than a few MB is mmap'ed on allocation and unmapped on free, and
freed memory at the top of the heap is trimmed back to the OS. A prefill step allocates and frees tens of
such buffers per layer (a 4,096-token MLP activation is 22 MB), so every one of them is page-faulted in
again: on the throughput benchmark's prefill that was about a third of the step. Raising the mmap threshold
to glibc's maximum (32 MiB) and the trim threshold to 1 GiB serves these buffers from the heap and keeps
the pages mapped, at the cost of the process holding on to up to 1 GiB of freed memory it has already
touched (its peak RSS does not grow).

Process-wide and one-way (glibc has no getter to restore from), so it is applied once, only by engines that
run on the CPU, only with glibc, and never when `HF_PAGED_TUNE_MALLOC=0`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper limit on 64-bit systems
TRIM_THRESHOLD = 1024 * 1024 * 1024


@functools.lru_cache(maxsize=1)
def tune_host_allocator() -> str:
    """Apply the settings above once per process; returns what happened (for stats and logs)."""
    if os.environ.get("HF_PAGED_TUNE_MALLOC", "1") == "0":
        return "disabled by HF_PAGED_TUNE_MALLOC=0"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc: left as is"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except (OSError, AttributeError) as e:
        return f"mallopt unavailable: {e}"
    return "tuned (mmap threshold 32 MiB, trim threshold 1 GiB)" if ok else "mallopt refused the settings"
