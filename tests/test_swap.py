"""kv/swap.py: block copies between KV tensors (one strided view per run, or contiguous slabs between devices)."""
import pytest
import torch

from hf_paged.kv import KVCache, KVCacheSpec
from hf_paged.kv.swap import SwapPool, contiguous_runs, copy_blocks


@pytest.mark.parametrize("piecewise", [False, True])
def test_copy_blocks_moves_exactly_the_named_blocks(piecewise):
    """kv.swap.copy_blocks, as one strided view per run or as layers x 2 contiguous slabs per run (how it copies
    between devices): scattered and consecutive ids, runs on one side only, every other block untouched."""
    src = torch.randn(3, 2, 20, 4, 2, 8)
    dst = torch.randn(3, 2, 24, 4, 2, 8)
    before = dst.clone()
    src_ids, dst_ids = [0, 1, 2, 7, 9, 10, 19, 5], [4, 5, 6, 0, 1, 2, 23, 11]
    assert len(contiguous_runs(src_ids, dst_ids)) == 5
    copy_blocks(src, dst, src_ids, dst_ids, piecewise=piecewise)
    expected = before.clone()
    for s, d in zip(src_ids, dst_ids):
        expected[:, :, d] = src[:, :, s]
    assert torch.equal(dst, expected)


def test_copy_blocks_refuses_unequal_lists():
    """A block copy with more destinations than sources is a caller's bug (a swap-in's list once grew with the
    request's table): it raises instead of pairing up what zip() would."""
    src, dst = torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2)
    with pytest.raises(ValueError, match="as many destinations as sources"):
        copy_blocks(src, dst, [0, 1], [2, 3, 1])


def test_overlapping_copies_within_one_storage_are_not_merged():
    """Found by review: copy-on-write copies (2 -> 1), (3 -> 2) were merged into one slice copy whose source and
    destination overlap (no defined element order on a GPU)."""
    assert contiguous_runs([2, 3], [1, 2], disjoint=True) == [(2, 1, 1), (3, 2, 1)]
    assert contiguous_runs([1, 2, 3], [7, 8, 9], disjoint=True) == [(1, 7, 3)]
    assert contiguous_runs([2, 3], [1, 2]) == [(2, 1, 2)]  # between two storages a run may look like that


def test_swap_pool_hands_out_lowest_ids_and_rolls_back_exactly():
    pool = SwapPool(KVCache(KVCacheSpec(1, 1, 2, torch.float32, torch.device("cpu")), 4, 2), 6)
    assert pool.allocate(2) == [0, 1] and pool.num_free == 4
    before = list(pool.free_ids)
    pool.begin()
    taken = pool.allocate(3)
    pool.free([0])
    pool.free(taken[:1])
    pool.rollback()
    assert pool.free_ids == before and pool.allocate(1) == [2]


def test_swap_out_and_in_round_trip_the_named_blocks():
    cache = KVCache(KVCacheSpec(2, 1, 2, torch.float32, torch.device("cpu")), 6, 2)
    cache.storage.copy_(torch.randn(cache.storage.shape))
    saved = cache.storage[:, :, [4, 1]].clone()
    pool = SwapPool(cache, 4)
    host = pool.allocate(2)
    pool.swap_out(cache, [4, 1], host)
    cache.storage.zero_()
    pool.swap_in(cache, host, [0, 3])
    pool.synchronize()
    assert torch.equal(cache.storage[:, :, [0, 3]], saved) and not cache.storage[:, :, [1, 2, 4, 5]].any()
