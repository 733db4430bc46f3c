"""Block table helpers: how many blocks tokens need, which entries hold a block, the released run."""
from __future__ import annotations

from .block_pool import NULL_BLOCK


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
