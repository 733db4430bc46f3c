"""Host swap space for preempted requests' KV blocks, and the block copies in both directions."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .cache import KVCache


def contiguous_runs(src: list[int], dst: list[int], disjoint: bool = False) -> list[tuple[int, int, int]]:
    """Split a block-to-block mapping into (src_start, dst_start, length) runs where both sides are consecutive,
    so a whole request usually moves as a few large copies instead of one per block. `disjoint` (a copy within one
    storage): a run's source and destination ranges never overlap (an overlapping slice copy has no defined order)."""
    if len(src) != len(dst):
        raise ValueError(f"a block copy needs as many destinations as sources, got {len(src)} and {len(dst)}")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d and not (
                disjoint and _overlap(runs[-1], s, d)):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int],
                piecewise: bool | None = None) -> None:
    """Copy blocks between storages shaped [layers, 2, num_blocks, ...] (any devices), run by run.

    A run of blocks is a strided view (one slab per layer and K/V). `piecewise` (default: when the two storages are
    on different devices) copies each run as its layers x 2 contiguous slabs instead of as one strided view: on an
    H200, a 512-block run copied as one strided view between device and pinned host moved 1.2-5.7 GB/s against a
    55 GB/s pinned copy ceiling."""
    if piecewise is None:
        piecewise = src.device.type != dst.device.type
    non_blocking = src.device.type != dst.device.type
    for s, d, n in contiguous_runs(src_ids, dst_ids, disjoint=src is dst):
        if not piecewise:
            dst[:, :, d:d + n].copy_(src[:, :, s:s + n], non_blocking=non_blocking)
            continue
        for layer in range(src.shape[0]):
            for kind in range(2):
                dst[layer, kind, d:d + n].copy_(src[layer, kind, s:s + n], non_blocking=non_blocking)


def _overlap(run: tuple[int, int, int], s: int, d: int) -> bool:
    """Whether `run` grown by (s, d) would read and write overlapping ranges."""
    start_s, start_d, n = run
    return start_s < start_d + n + 1 and start_d < start_s + n + 1


BlockCopy = Callable[[torch.Tensor, torch.Tensor, list, list], None]


class SwapPool:
    """`num_blocks` host blocks (pinned memory when the KV cache lives on CUDA) with an O(1) free list.

    Copies run on a side stream on CUDA; `synchronize()` makes the forward pass wait for them. Lowest ids
    are handed out first, so a request's blocks land in few contiguous runs.
    """

    def __init__(self, cache: KVCache, num_blocks: int, copy: BlockCopy = copy_blocks):
        self.copy = copy  # how blocks move between the cache and the pool (the CUDA kernel where it is built)
        shape = (cache.storage.shape[0], 2, num_blocks, *cache.storage.shape[3:])
        pin = cache.storage.device.type == "cuda"
        self.storage = torch.empty(shape, dtype=cache.storage.dtype, device="cpu", pin_memory=pin)
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest id
        self.stream = torch.cuda.Stream(cache.storage.device) if pin else None
        self.bytes_per_block = self.storage[:, :, :1].numel() * self.storage.element_size()
        self._undo: list[tuple[int, list[int]]] | None = None  # while a step runs: (pushed count, popped ids)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, count: int) -> list[int]:
        ids = [self.free_ids.pop() for _ in range(count)]
        if self._undo is not None:
            self._undo.append((0, ids))
        return ids

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(reversed(ids))
        if self._undo is not None:
            self._undo.append((len(ids), []))

    def begin(self) -> None:
        """Record allocations and frees from now on, so that `rollback` restores the free list exactly."""
        self._undo = []

    def commit(self) -> None:
        self._undo = None

    def rollback(self) -> None:
        undo, self._undo = self._undo or [], None
        for pushed, popped in reversed(undo):
            if pushed:
                del self.free_ids[-pushed:]
            self.free_ids.extend(reversed(popped))

    def _copy(self, src, dst, src_ids, dst_ids) -> None:
        if self.stream is None:
            self.copy(src, dst, src_ids, dst_ids)
            return
        self.stream.wait_stream(torch.cuda.current_stream(src.device if src.is_cuda else dst.device))
        with torch.cuda.stream(self.stream):
            self.copy(src, dst, src_ids, dst_ids)

    def swap_out(self, cache: KVCache, device_ids: list[int], host_ids: list[int]) -> None:
        self._copy(cache.storage, self.storage, device_ids, host_ids)

    def swap_in(self, cache: KVCache, host_ids: list[int], device_ids: list[int]) -> None:
        self._copy(self.storage, cache.storage, host_ids, device_ids)

    def synchronize(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.stream.synchronize()  # host blocks are reused right after; their copies must be done


def measure_copy_bandwidth(cache: KVCache, blocks: int = 32, copy: BlockCopy = copy_blocks) -> float:
    """Bytes per second of a device -> host -> device round trip of a few blocks by `copy` (the swap pool's own
    copy, for preemption_mode="auto"). The first round trip only faults pages in; the second is timed."""
    blocks = max(1, min(blocks, cache.num_blocks))
    ids = list(range(blocks))
    shape = (*cache.storage.shape[:2], blocks, *cache.storage.shape[3:])
    host = torch.empty(shape, dtype=cache.storage.dtype, device="cpu", pin_memory=cache.storage.is_cuda)
    for timed in (False, True):
        start = time.perf_counter()
        copy(cache.storage, host, ids, ids)
        copy(host, cache.storage, ids, ids)
        if cache.storage.is_cuda:
            torch.cuda.synchronize(cache.storage.device)
        seconds = max(time.perf_counter() - start, 1e-9)
    return 2 * host.numel() * host.element_size() / seconds
