"""Physical blocks, their reference counts, the free queue and the prefix map. Knows nothing about models."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    """One fixed-size page of KV memory.

    `ref_count == 0` exactly when the block is in the free queue. A block with a `block_hash` holds the
    K/V of `token_ids` computed right after `parent` (None: the first block) as it was in incarnation
    `parent_generation`; it stays findable in the prefix map until it is reused. Every allocation bumps
    `generation`, so a child never follows a later incarnation of its parent.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    parent: "Block | None" = None
    parent_generation: int = 0
    generation: int = 0
    prev: "Block | None" = None
    next: "Block | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the front, push to either end, and removal
    from the middle (to revive a cached block on a prefix hit). Never uses list.remove. `before_change`, when set,
    is called with every block (sentinels included) whose links are about to change (the pool's undo journal)."""

    def __init__(self, blocks: list[Block]):
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        self.before_change = None
        for block in blocks:
            self.push_back(block)

    def _link(self, block: Block, before: Block) -> None:
        after = before.next
        if self.before_change is not None:
            for changed in (block, before, after):
                self.before_change(changed)
        block.prev, block.next = before, after
        before.next = after.prev = block
        self.num_free += 1

    def push_front(self, block: Block) -> None:
        self._link(block, self._head)

    def push_back(self, block: Block) -> None:
        self._link(block, self._tail.prev)

    def remove(self, block: Block) -> None:
        if self.before_change is not None:
            for changed in (block, block.prev, block.next):
                self.before_change(changed)
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def pop_front(self) -> Block:
        block = self._head.next
        if block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block


@contextmanager
def _no_gc():
    """The cyclic garbage collector paused (a default CPU pool of a tiny model is 262,143 blocks: 0.5 s to build with
    it running, 0.1 s without)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(slots=True, eq=False)
class Journal:
    """What `BlockPool.rollback` needs: each changed block's fields before its first change (keyed by id(), so the
    free queue's two sentinels count apart), each changed prefix-map key's block before (None: absent), the free
    count at `begin`, and the blocks handed out since."""

    num_free: int
    blocks: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)
    allocated: set = field(default_factory=set)


NULL_BLOCK = 0  # a block of the KV storage that is never handed out: padding rows and table padding point at it


class BlockPool:
    """`num_blocks` usable blocks (ids 1..num_blocks) with reference counts and lazy eviction.

    Block id 0 is the reserved null block: the KV storage has `num_blocks + 1` blocks, and padding (table entries
    past a sequence's length, padding rows of a padded step) points at block 0, which no request ever owns.

    Freed blocks without a hash go to the front of the free queue (reused first, lowest first, so a lightly
    loaded pool keeps few pages resident); freed hashed blocks go to the back, in least-recently-used order,
    and keep their contents until the queue reaches them. Allocation evicts a hashed block only then.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        with _no_gc():  # hundreds of thousands of linked objects: the collector would walk the heap again and again
            self.blocks = [Block(i) for i in range(num_blocks + 1)]  # blocks[NULL_BLOCK] is never free nor held
            self.free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK + 1:])
        self.cached: dict[bytes, Block] = {}
        self._journal: Journal | None = None  # while a step runs: how to undo it (see `begin`)

    # ---- all or nothing --------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start recording every change, so that `rollback` can put the pool back exactly as it is now."""
        self._journal = Journal(self.free_queue.num_free)
        self.free_queue.before_change = self._save

    def commit(self) -> None:
        """Keep every change since `begin`."""
        self._journal = None
        self.free_queue.before_change = None

    def rollback(self) -> set[int]:
        """Undo every change since `begin` (reference counts, free queue order, prefix map, generations). Returns
        the blocks handed out meanwhile: their memory may have been written since, so the caller must not trust
        what they held (they are dropped from the prefix map here)."""
        journal, self._journal = self._journal, None
        self.free_queue.before_change = None
        if journal is None:
            return set()
        for block, fields in journal.blocks.values():
            (block.ref_count, block.block_hash, block.token_ids, block.parent, block.parent_generation,
             block.generation, block.prev, block.next) = fields
        for key, block in journal.keys.items():
            if block is None:
                self.cached.pop(key, None)
            else:
                self.cached[key] = block
        self.free_queue.num_free = journal.num_free
        for block_id in journal.allocated:
            self.uncache(block_id)
        return journal.allocated

    def _save(self, block: Block) -> None:
        journal = self._journal
        if journal is not None and id(block) not in journal.blocks:
            journal.blocks[id(block)] = (block, (block.ref_count, block.block_hash, block.token_ids, block.parent,
                                                 block.parent_generation, block.generation, block.prev, block.next))

    def _save_key(self, key: bytes) -> None:
        journal = self._journal
        if journal is not None and key not in journal.keys:
            journal.keys[key] = self.cached.get(key)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def grow(self, extra: int) -> None:
        """Add `extra` free blocks (ids num_blocks+1 .. num_blocks+extra); the caller grows the storage to match."""
        first = self.num_blocks + 1
        self.num_blocks += extra
        for block_id in range(first, first + extra):
            block = Block(block_id)
            self.blocks.append(block)
            self.free_queue.push_back(block)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (ref_count becomes 1). Raises if fewer are free; callers check first."""
        if count > self.free_queue.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, only {self.free_queue.num_free} free")
        taken = []
        for _ in range(count):
            block = self.free_queue.pop_front()
            self._save(block)
            if self._journal is not None:
                self._journal.allocated.add(block.block_id)
            if block.block_hash is not None:
                self._evict(block)
            block.generation += 1  # new contents: children cached after the old contents no longer follow it
            block.ref_count = 1
            taken.append(block.block_id)
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Freed in reverse so a chain's deepest blocks are evicted
        first and a table's first block is handed out first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block_id == NULL_BLOCK:
                raise RuntimeError("the null KV block is never handed out, so it cannot be freed")
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self._save(block)
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.push_front(block)
                else:
                    self.free_queue.push_back(block)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on prefix-hit blocks, reviving those that sat in the free queue."""
        for block in blocks:
            self._save(block)
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def lookup(self, block_hash: bytes, token_ids: list[int], parent: Block | None,
               any_parent: bool = False) -> Block | None:
        """The block holding exactly these tokens right after `parent` (the previous hit), if any. The hash
        is only a hint: a hit must match token for token and follow this very parent incarnation, so even a
        colliding hash can never serve K/V computed after a different prefix. `any_parent`: the caller holds no
        parent (a sliding window's first block), and takes the keyed chain hash's word for the prefix."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        if any_parent:
            return block
        if block.parent is not parent:
            return None
        if parent is not None and block.parent_generation != parent.generation:
            return None
        return block

    def cache(self, block_id: int, block_hash: bytes, token_ids: list[int], parent: Block | None) -> None:
        """Make a full, computed block findable. A key already served by another block keeps that block."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        self._save(block)
        self._save_key(block_hash)
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        block.parent, block.parent_generation = parent, parent.generation if parent is not None else 0
        self.cached[block_hash] = block

    def uncache(self, block_id: int) -> None:
        """Make a block unfindable in the prefix map (its contents are not to be trusted)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._evict(block)

    def _evict(self, block: Block) -> None:
        self._save(block)
        self._save_key(block.block_hash)
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent = None

    def check_all_free(self) -> None:
        """Raise unless every block is free with a zero reference count (used by tests and stats)."""
        busy = [b.block_id for b in self.blocks if b.ref_count != 0]
        if busy or self.free_queue.num_free != self.num_blocks:
            raise AssertionError(f"blocks still referenced: {busy[:10]} (free {self.free_queue.num_free}/{self.num_blocks})")
