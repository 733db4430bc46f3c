"""Per-request block tables on top of the block pool."""
from __future__ import annotations

from ..request import Request
from .block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows and releases each request's `block_table` (logical block i -> physical block id).

    Invariant: a request's table covers `num_computed_tokens + scheduled new tokens` slots after a
    successful `allocate_slots`, and is empty after `free`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._fresh: list[int] = []  # handed out since the last take_fresh_blocks()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        total = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_table))

    def allocate_slots(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        """Extend the table to hold `num_new_tokens` more tokens, keeping `reserve` blocks free.
        Returns False (and changes nothing) when the pool cannot cover it."""
        need = self.num_new_blocks(request, num_new_tokens)
        if need > self.pool.num_free_blocks - reserve:
            return False
        if need:
            ids = self.pool.allocate(need)
            request.block_table.extend(ids)
            self._fresh.extend(ids)
        return True

    def take_fresh_blocks(self) -> list[int]:
        """Blocks handed out since the last call (the runner clears their memory once)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def free(self, request: Request) -> None:
        self.pool.free(request.block_table)
        request.block_table = []

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """Flat slot (block_id * block_size + offset) of token positions [start, end)."""
        bs, table = self.block_size, request.block_table
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
