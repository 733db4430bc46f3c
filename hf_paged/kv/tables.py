"""Block table helpers: how many blocks tokens need, which entries hold a block, the released run, copy-on-write and
window release (shared by the engine's KV manager and a PagedCache's store)."""
from __future__ import annotations

from typing import Callable

from .block_pool import NULL_BLOCK, BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def held(table: list[int]) -> list[int]:
    """A table's entries that hold a block (not the null block of a released slot)."""
    return [block for block in table if block != NULL_BLOCK]


def released_prefix(table: list[int]) -> int:
    """How many leading entries of a block table a sliding window gave back (the null block)."""
    count = 0
    while count < len(table) and table[count] == NULL_BLOCK:
        count += 1
    return count


def copy_on_write(pool: BlockPool, table: list[int], index: int,
                  allocate: Callable[[int], list[int]] | None = None) -> tuple[int, int] | None:
    """Before a table writes into its entry `index`: when other tables hold that block too, this table gets a private
    copy (a new block, one reference less on the shared one). Returns (source, copy) for the caller to copy the memory
    (all of the block's layers: their earlier slots are this table's past), or None when the block is its own. The one
    copy-on-write of the engine's KV manager and of a PagedCache's store."""
    block_id = table[index]
    if pool.blocks[block_id].ref_count <= 1:
        return None
    (copy,) = (allocate or pool.allocate)(1)
    pool.free([block_id])
    table[index] = copy
    return block_id, copy


def release_leading(pool: BlockPool, table: list[int], count: int) -> list[int]:
    """Give back the blocks of the table's first `count` entries (a sliding window's queries never read them again):
    those entries become the null block and their blocks lose one reference. Returns the blocks given back. The one
    window release of the engine's KV manager and of a PagedCache's store."""
    count = min(count, len(table))
    gone = held(table[:count])
    if gone:
        pool.free(gone)
        table[:count] = [NULL_BLOCK] * count
    return gone
