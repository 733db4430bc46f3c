"""Physical blocks, their reference counts and the free queue. Knows nothing about models."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """One fixed-size page of KV memory. `ref_count == 0` exactly when the block is in the free queue."""

    block_id: int
    ref_count: int = 0
    prev: "Block | None" = None
    next: "Block | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the front, push to either end, and removal
    from the middle (needed later to revive a cached block). Never uses list.remove."""

    def __init__(self, blocks: list[Block]):
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.push_back(block)

    def _link(self, block: Block, before: Block) -> None:
        after = before.next
        block.prev, block.next = before, after
        before.next = after.prev = block
        self.num_free += 1

    def push_front(self, block: Block) -> None:
        self._link(block, self._head)

    def push_back(self, block: Block) -> None:
        self._link(block, self._tail.prev)

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def pop_front(self) -> Block:
        block = self._head.next
        if block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block


class BlockPool:
    """`num_blocks` blocks; allocation hands out the lowest recently-freed blocks first so that a
    lightly loaded pool touches (and keeps resident) as little memory as possible."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (ref_count becomes 1). Raises if fewer are free; callers check first."""
        if count > self.free_queue.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, only {self.free_queue.num_free} free")
        taken = []
        for _ in range(count):
            block = self.free_queue.pop_front()
            block.ref_count = 1
            taken.append(block.block_id)
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back to the front of the queue.
        Freed in reverse so the first block of a table is handed out first next time."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.push_front(block)

    def check_all_free(self) -> None:
        """Raise unless every block is free with a zero reference count (used by tests and stats)."""
        busy = [b.block_id for b in self.blocks if b.ref_count != 0]
        if busy or self.free_queue.num_free != self.num_blocks:
            raise AssertionError(f"blocks still referenced: {busy[:10]} (free {self.free_queue.num_free}/{self.num_blocks})")
