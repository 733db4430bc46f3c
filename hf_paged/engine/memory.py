"""The engine's KV memory: how big the pool is, the cache tensors, the host swap pool, and the block moves a
step's plan asks for before its forward pass."""
from __future__ import annotations

import torch

from ..attention import cuda_backend
from ..config import EngineConfig, available_host_memory, default_kv_cache_bytes, default_swap_bytes, logger
from ..kv import NULL_BLOCK, KVCache, KVCacheSpec, choose_num_blocks
from ..kv.swap import BlockCopy, SwapPool, copy_blocks, measure_copy_bandwidth
from .plan import StepPlan


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def check_memory_budget(spec: KVCacheSpec, config: EngineConfig, num_blocks: int) -> None:
    """Refuse, before allocating, a KV pool (num_blocks + the null block) or an explicit host swap space larger than
    the memory available now: the device's free memory on CUDA, else available RAM (MemAvailable; on CPU the pool and
    the swap space share it). Otherwise the failure comes late, when the pages are first touched."""
    per_block = spec.bytes_per_block(config.block_size)
    pool = (num_blocks + 1) * per_block
    asked = (f"num_blocks={config.num_blocks}" if config.num_blocks is not None
             else f"kv_cache_memory={config.kv_cache_memory}" if config.kv_cache_memory else "default size")
    pool_text = f"the KV cache ({asked}: {num_blocks + 1} blocks x {per_block} bytes = {_gib(pool)})"
    if spec.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(spec.device)
        if pool > free:
            raise ValueError(f"{pool_text} exceeds the free memory of {spec.device} ({_gib(free)}); lower num_blocks "
                             f"or kv_cache_memory")
        pool = 0  # only the swap space lives in host memory
    swap = 0 if config.preemption_mode == "recompute" else (config.swap_space or 0)
    host = available_host_memory()
    if pool + swap > host:
        parts = ([pool_text] if pool else []) + ([f"swap_space ({_gib(swap)})"] if swap else [])
        knobs = (["num_blocks", "kv_cache_memory"] if pool else []) + (["swap_space"] if swap else [])
        raise ValueError(f"{' plus '.join(parts)} exceeds the available host memory ({_gib(host)}); lower "
                         f"{' or '.join(knobs)}")


def swap_copy(device: torch.device, attention_backend: str) -> BlockCopy:
    """How swaps move blocks: on CUDA, the extension's copy kernel (one launch however scattered the blocks; 48-51 GB/s
    between an H200 and pinned host memory, against 1.2-6.8 GB/s for torch copies run by run, in
    hf_paged/bench/gpu_check.py swap) when the attention backend may build the extension anyway ("auto", "cuda") and it
    builds; else torch copies (kv.swap.copy_blocks), so that no other backend's engine waits for an nvcc build."""
    if device.type == "cuda" and attention_backend in ("auto", "cuda") and cuda_backend.unavailable_reason(device) is None:
        return cuda_backend.copy_blocks
    return copy_blocks


class KVMemory:
    """`num_blocks` pool blocks plus the null block (id 0) in one `KVCache`, and an optional host `SwapPool`.

    Invariants: the null block holds zeros from the start and only padding ever writes it; every block the pool
    hands out is cleared before its first forward pass (the plan's `blocks_to_clear`), so masked slots never hold
    NaN. `copy_bytes_per_s` is measured only when there is swap space to decide about.
    """

    def __init__(self, spec: KVCacheSpec, config: EngineConfig):
        budget = config.kv_cache_memory or (default_kv_cache_bytes(spec.device) if config.num_blocks is None
                                            else 0)  # a given block count needs no budget (nor a look at RAM)
        self.num_blocks = choose_num_blocks(spec, config.block_size, config.num_blocks, budget)
        if config.num_blocks is None and self.num_blocks > 1:
            self.num_blocks -= 1  # the null block comes out of the byte budget too
        check_memory_budget(spec, config, self.num_blocks)
        self.cache = KVCache(spec, self.num_blocks + 1, config.block_size)  # + the null block
        self.cache.storage[:, :, NULL_BLOCK].zero_()
        self.swap = self._make_swap_pool(spec, config)
        self.copy_bytes_per_s = (measure_copy_bandwidth(self.cache, copy=self.swap.copy) if self.swap is not None
                                 else None)

    def _make_swap_pool(self, spec: KVCacheSpec, config: EngineConfig) -> SwapPool | None:
        if config.preemption_mode == "recompute" or not spec.stored_layers:
            return None
        budget = config.swap_space
        budget = default_swap_bytes(spec.device) if budget is None else budget
        num_blocks = budget // spec.bytes_per_block(config.block_size)
        if num_blocks < 1:
            if config.preemption_mode == "swap":
                raise ValueError("preemption_mode='swap' needs swap_space (bytes) for at least one block")
            return None
        logger.info("hf_paged swap space: %d blocks (%.1f MiB)", num_blocks, budget / 2**20)
        return SwapPool(self.cache, int(num_blocks), swap_copy(spec.device, config.attention_backend))

    def apply(self, plan: StepPlan) -> None:
        """Run the plan's block moves: save swapped-out blocks, copy-on-write copies, clear newly handed-out blocks
        (not the copies' destinations: a copy fills them whole), restore swapped-in ones. In that order: a block freed
        in this step may be handed out again in it, so it is saved and copied from before anything overwrites it
        (a copy's source, shared with a sample preempted in this step, may be handed out to be cleared)."""
        for device_ids, host_ids in plan.swap_out:
            self.swap.swap_out(self.cache, device_ids, host_ids)
        if plan.swap_out:
            self.swap.synchronize()
        if plan.copies:
            sources, destinations = zip(*plan.copies)
            copy_blocks(self.cache.storage, self.cache.storage, list(sources), list(destinations))
            filled = set(destinations)
            self.clear([b for b in plan.blocks_to_clear if b not in filled])
        else:
            self.clear(plan.blocks_to_clear)
        for host_ids, device_ids in plan.swap_in:
            self.swap.swap_in(self.cache, host_ids, device_ids)
        if plan.swap_in:
            self.swap.synchronize()
            for host_ids, _ in plan.swap_in:
                self.swap.free(host_ids)

    def clear(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        storage = self.cache.storage
        if len(block_ids) <= 8:  # a few strided views beat one advanced-index write
            for b in block_ids:
                storage[:, :, b].zero_()
        else:
            storage[:, :, torch.tensor(block_ids, device=storage.device)] = 0

    def sleep(self) -> None:
        """Give the KV pool's memory back (the engine holds no K/V it will read again); the host swap space stays."""
        self.cache.release()
        if self.cache.spec.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Take the pool's memory again; the null block holds zeros again (every other block is cleared when handed
        out)."""
        if self.cache.released:
            self.cache.restore()
            self.cache.storage[:, :, NULL_BLOCK].zero_()

    @property
    def num_swap_blocks_free(self) -> int:
        return self.swap.num_free if self.swap is not None else 0

    def check_swap_idle(self) -> None:
        if self.swap is not None and self.swap.num_free != self.swap.num_blocks:
            raise AssertionError(f"swap blocks still held: {self.swap.num_blocks - self.swap.num_free}")
