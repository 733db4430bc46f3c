"""kv/block_pool.py: the block pool's O(1) free queue, reference counts, lowest-first reuse, the null block."""
import pytest

from hf_paged.kv import NULL_BLOCK, BlockPool


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


def test_lookup_never_follows_a_later_incarnation_of_the_parent():
    """The one pool check the machines rarely reach: a cached child whose parent block was uncached (discarded),
    handed out again and cached anew for the same tokens is no hit after the new parent, even under a colliding key."""
    pool = BlockPool(4)
    parent, child = pool.allocate(2)
    pool.cache(parent, b"p", [1, 2], None)
    pool.cache(child, b"c", [3, 4], pool.blocks[parent])
    assert pool.lookup(b"c", [3, 4], pool.blocks[parent]) is pool.blocks[child]
    pool.uncache(parent)  # discard_contents of a request that held the parent only
    pool.free([parent])
    assert pool.allocate(1) == [parent]  # unhashed: handed out first, new contents
    pool.cache(parent, b"p2", [1, 2], None)
    assert pool.lookup(b"c", [3, 4], pool.blocks[parent]) is None
    pool.free([parent, child])
    pool.check_all_free()


def test_freed_cached_blocks_stay_findable_until_reused_least_recently_used_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"a", [1], None)
    pool.cache(b, b"b", [2], None)
    pool.free([a])
    pool.free([b])
    pool.free([c])  # unhashed: to the front, reused first
    assert pool.lookup(b"a", [1], None) is pool.blocks[a]
    pool.touch([pool.blocks[b]])  # a prefix hit revives it from the free queue
    assert pool.blocks[b].ref_count == 1 and pool.num_free_blocks == 2
    assert pool.allocate(1) == [c] and pool.lookup(b"a", [1], None) is pool.blocks[a]
    assert pool.allocate(1) == [a]  # the last free block: evicted on reuse
    assert pool.lookup(b"a", [1], None) is None and pool.lookup(b"b", [2], None) is pool.blocks[b]
    assert pool.lookup(b"b", [9], None) is None  # the key is a hint: the tokens must match


def test_rollback_restores_the_pool_exactly_and_reports_blocks_handed_out():
    pool = BlockPool(5)
    held = pool.allocate(2)
    pool.cache(held[0], b"k", [1, 2], None)
    pool.free([held[0]])

    def state():
        order, block = [], pool.free_queue._head.next
        while block is not pool.free_queue._tail:
            order.append(block.block_id)
            block = block.next
        return (order, pool.num_free_blocks, dict(pool.cached),
                [(b.ref_count, b.block_hash, b.generation) for b in pool.blocks])

    before = state()
    pool.begin()
    taken = pool.allocate(3)  # the unhashed free blocks
    pool.free([held[1]])
    pool.cache(taken[0], b"new", [7], None)
    assert pool.rollback() == set(taken)
    assert state() == before
    pool.begin()
    pool.allocate(4)  # reuses the cached block too: its memory may have been written, so it is no hit after undo
    pool.rollback()
    assert pool.lookup(b"k", [1, 2], None) is None and state()[:2] == before[:2]
    pool.begin()
    pool.allocate(1)
    pool.commit()
    assert pool.rollback() == set() and pool.num_free_blocks == 3  # after commit nothing is undone


def test_grow_adds_free_blocks_after_the_last_id():
    pool = BlockPool(2)
    pool.allocate(2)
    pool.grow(3)
    assert pool.num_blocks == 5 and pool.allocate(3) == [3, 4, 5]
    with pytest.raises(ValueError):
        BlockPool(0)
