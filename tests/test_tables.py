"""kv/tables.py: block counts, held entries, the released run, copy-on-write and window release on a block pool."""
from hf_paged.kv import NULL_BLOCK, BlockPool
from hf_paged.kv.tables import blocks_needed, copy_on_write, held, release_leading, released_prefix


def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_held_and_released_prefix():
    table = [NULL_BLOCK, NULL_BLOCK, 4, 6]
    assert held(table) == [4, 6] and released_prefix(table) == 2
    assert released_prefix([3, NULL_BLOCK]) == 0 and released_prefix([NULL_BLOCK]) == 1 and released_prefix([]) == 0


def test_copy_on_write_copies_only_a_shared_block():
    pool = BlockPool(4)
    table = pool.allocate(2)
    assert copy_on_write(pool, table, 1) is None and pool.num_free_blocks == 2  # its own: written in place
    shared = table[1]
    pool.blocks[shared].ref_count += 1  # a second table holds it too
    source, copy = copy_on_write(pool, table, 1)
    assert (source, table[1]) == (shared, copy) and copy != shared
    assert pool.blocks[shared].ref_count == 1 and pool.blocks[copy].ref_count == 1


def test_release_leading_gives_back_the_window_once():
    pool = BlockPool(4)
    table = pool.allocate(3)
    first = table[:2]
    assert release_leading(pool, table, 2) == first
    assert table[:2] == [NULL_BLOCK, NULL_BLOCK] and pool.num_free_blocks == 3
    assert release_leading(pool, table, 2) == []  # already given back: nothing freed twice
    last = table[2]
    assert release_leading(pool, table, 10) == [last]  # a count past the table's end stops at its end
    assert table == [NULL_BLOCK] * 3 and pool.num_free_blocks == 4
