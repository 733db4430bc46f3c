"""engine/memory.py: the KV pool's size is checked against the memory there is, and a step's block moves run in
the order the plan documents (swap out, copy, clear all but the copies' destinations, swap in)."""
import pytest
import torch

import hf_paged.engine.memory as memory
from hf_paged import EngineConfig
from hf_paged.engine.memory import KVMemory
from hf_paged.engine.plan import StepPlan
from hf_paged.kv import NULL_BLOCK, KVCacheSpec

SPEC = KVCacheSpec(2, 1, 4, torch.float32, torch.device("cpu"))


def kv_memory(**options):
    config = EngineConfig(block_size=2, num_blocks=6, preemption_mode="swap", swap_space=4 * SPEC.bytes_per_block(2),
                          attention_backend="torch", **options)
    mem = KVMemory(SPEC, config)
    storage = mem.cache.storage
    storage[:, :, 1:] = torch.arange(1, 7, dtype=storage.dtype).view(1, 1, 6, 1, 1, 1)  # block b holds b
    return mem


def blocks(mem):
    """What each block holds (its first element; every block is filled with one value here)."""
    return mem.cache.storage[0, 0, :, 0, 0, 0].tolist()


def test_the_pool_has_the_null_block_besides_num_blocks_and_it_holds_zeros():
    mem = KVMemory(SPEC, EngineConfig(block_size=2, num_blocks=6, preemption_mode="recompute"))
    assert mem.num_blocks == 6 and mem.cache.num_blocks == 7 and mem.swap is None
    assert not mem.cache.storage[:, :, NULL_BLOCK].any()


def test_apply_copies_before_clearing_and_never_clears_a_copy_destination():
    mem = kv_memory()
    plan = StepPlan(copies=[(2, 5), (3, 6)], blocks_to_clear=[2, 5, 4])  # 2 is freed and handed out again
    mem.apply(plan)
    assert blocks(mem) == [0, 1, 0, 3, 0, 2, 3]


def test_apply_swaps_out_before_the_block_is_cleared_and_swaps_in_after():
    mem = kv_memory()
    out = mem.swap.allocate(2)
    mem.apply(StepPlan(swap_out=[([3, 4], out)], blocks_to_clear=[3, 4]))
    assert blocks(mem) == [0, 1, 2, 0, 0, 5, 6] and mem.num_swap_blocks_free == 2
    mem.apply(StepPlan(swap_in=[(out, [1, 2])], blocks_to_clear=[1, 2]))
    assert blocks(mem) == [0, 3, 4, 0, 0, 5, 6]
    mem.check_swap_idle()  # the swapped-in host blocks went back to the swap pool


def test_wake_up_gives_back_a_zero_null_block():
    mem = kv_memory()
    mem.sleep()
    assert mem.cache.num_bytes == 0
    mem.wake_up()
    assert not mem.cache.storage[:, :, NULL_BLOCK].any() and mem.cache.storage.shape[2] == 7


def test_kv_budget_on_cuda_is_checked_against_free_device_memory(monkeypatch):
    """The CUDA branch, without a GPU: the pool must fit the device's free memory (host memory is not asked)."""
    spec = KVCacheSpec(2, 2, 16, torch.float32, torch.device("cuda", 0))
    per_block = spec.bytes_per_block(8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * per_block, 1 << 40))
    monkeypatch.setattr(memory, "available_host_memory", lambda: 0)
    with pytest.raises(ValueError, match=r"\(num_blocks=100: 101 blocks .* exceeds the free memory of cuda:0"):
        memory.check_memory_budget(spec, EngineConfig(block_size=8, num_blocks=100), 100)
    memory.check_memory_budget(spec, EngineConfig(block_size=8, num_blocks=99), 99)
