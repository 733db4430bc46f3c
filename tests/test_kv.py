"""Block pool and block tables: O(1) free queue, reference counts, lowest-first reuse."""
import pytest

from hf_paged.kv import BlockPool, KVCacheManager
from hf_paged.request import Request
from hf_paged.sampling import SamplingParams


def test_allocate_free_roundtrip_and_double_free():
    pool = BlockPool(6)
    a = pool.allocate(4)
    assert a == [0, 1, 2, 3] and pool.num_free_blocks == 2
    pool.free(a)
    assert pool.allocate(2) == [0, 1]  # freed blocks come back first, lowest first
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([5])
    with pytest.raises(RuntimeError, match="only"):
        pool.allocate(10)


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


def test_manager_grows_tables_and_maps_slots():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = Request("r", 0, list(range(6)), SamplingParams())
    assert kv.allocate_slots(req, 6) and len(req.block_table) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) and len(req.block_table) == 2  # still fits block 2
    assert not kv.allocate_slots(req, 20)  # refuses, changes nothing
    assert len(req.block_table) == 2
    table = req.block_table
    assert kv.slot_mapping(req, 3, 6) == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    kv.free(req)
    assert req.block_table == [] and kv.num_free_blocks == 4
