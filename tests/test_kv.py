"""Block pool and block tables: O(1) free queue, reference counts, lowest-first reuse."""
import pytest
import torch

from hf_paged.kv import NULL_BLOCK, BlockPool, KVCacheManager
from hf_paged.request import Request, RequestGroup
from hf_paged.sampling import SamplingParams


def make_request(tokens, **params):
    group = RequestGroup("r", 0, None, list(tokens))
    return Request(group, list(tokens), SamplingParams(**params))


def test_allocate_free_roundtrip_and_double_free():
    pool = BlockPool(6)
    a = pool.allocate(4)
    assert a == [1, 2, 3, 4] and pool.num_free_blocks == 2  # block 0 is the null block, never handed out
    pool.free(a)
    assert pool.allocate(2) == [1, 2]  # freed blocks come back first, lowest first
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([5])
    with pytest.raises(RuntimeError, match="null KV block"):
        pool.free([NULL_BLOCK])
    with pytest.raises(RuntimeError, match="only"):
        pool.allocate(10)
    assert NULL_BLOCK not in pool.allocate(4)


def test_reference_counts_and_all_free_check():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.blocks[block].ref_count += 1  # shared by a second owner
    pool.free([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.check_all_free()
    pool.free([block])
    pool.check_all_free()


def test_manager_grows_tables():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request(range(6))
    assert kv.allocate_slots(req, 6) and len(req.block_table) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) and len(req.block_table) == 2  # still fits block 2
    assert not kv.allocate_slots(req, 20)  # refuses, changes nothing
    assert len(req.block_table) == 2
    kv.free(req)
    assert req.block_table == [] and kv.num_free_blocks == 4


def test_blocks_are_cleared_once_and_again_after_their_contents_were_discarded():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request(range(8))
    assert kv.allocate_slots(req, 8)
    first = list(req.block_table)
    assert sorted(kv.take_blocks_to_clear()) == sorted(first)  # never used: clear before the first forward
    kv.free(req)
    assert kv.allocate_slots(req, 8) and kv.take_blocks_to_clear() == []  # clean since: nothing to clear
    kv.discard_contents(req)  # e.g. its K/V went NaN
    kv.free(req)
    assert kv.allocate_slots(req, 8) and sorted(kv.take_blocks_to_clear()) == sorted(req.block_table)


def test_discarded_blocks_leave_the_prefix_map():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(range(9))
    assert kv.allocate_slots(req, 9)
    req.num_computed_tokens = 9
    kv.cache_full_blocks(req)
    again = make_request(range(9))
    assert len(kv.computed_blocks(again)) == 2
    kv.discard_contents(req)
    assert kv.computed_blocks(make_request(range(9))) == []


def test_prefix_hits_never_cover_the_last_prompt_token():
    """A prompt of whole blocks that is all cached still computes its last token (its logits are sampled), even
    after its hash chain was extended further (as happens while it waits for a prefix being computed)."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    long = make_request(range(12))
    assert kv.allocate_slots(long, 12)
    long.num_computed_tokens = 12
    kv.cache_full_blocks(long)
    short = make_request(range(8))
    assert kv.common_prefix_blocks(short, long) == 2  # computes both of its block hashes
    assert len(kv.computed_blocks(short)) == 1


@pytest.mark.parametrize("piecewise", [False, True])
def test_copy_blocks_moves_exactly_the_named_blocks(piecewise):
    """kv.swap.copy_blocks, as one strided view per run or as layers x 2 contiguous slabs per run (how it copies
    between devices): scattered and consecutive ids, runs on one side only, every other block untouched."""
    from hf_paged.kv.swap import contiguous_runs, copy_blocks

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
    from hf_paged.kv.swap import copy_blocks

    src, dst = torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2)
    with pytest.raises(ValueError, match="as many destinations as sources"):
        copy_blocks(src, dst, [0, 1], [2, 3, 1])
