"""Prefix hits across KV groups: the longest run of a request's leading full blocks that every group can serve."""
from __future__ import annotations

from .block_pool import Block, BlockPool
from .groups import KVGroup
from .state import StateCheckpoints


def group_key(group: int, key: bytes) -> bytes:
    """Group `group`'s prefix-map key for a block of chain key `key` (each group caches its own blocks)."""
    return key if group == 0 else key + group.to_bytes(2, "little")


def first_seen(group: KVGroup, num_blocks: int, block_size: int) -> int:
    """The first block a query right after `num_blocks` full blocks reads in `group` (0 unless it slides)."""
    return group.first_needed(num_blocks * block_size) // block_size


def find_hits(pool: BlockPool, groups: tuple[KVGroup, ...], block_size: int, keys: list[bytes], tokens: list[int],
              checkpoints: StateCheckpoints | None = None) -> list[tuple[Block | None, ...]]:
    """Cached blocks for the blocks whose chain keys are `keys`: one row per block of the hit, one entry per group
    (None: a block that group's sliding window no longer sees from the hit point; not needed, not taken).

    The hit is the longest every group serves: a full-attention group needs every block of it, each following the
    very incarnation of the one before (a chain); a sliding group needs only the blocks its window sees from the hit
    point, found by key and tokens (the keyed chain hash covers every token before); with `checkpoints` (a model
    with state layers) the hit must also end at a block whose state was checkpointed. A shorter hit may satisfy a
    sliding group or a checkpoint that a longer one does not, so the length is lowered until all agree."""
    found: list[list[Block | None]] = []
    limit = len(keys)
    for g, group in enumerate(groups):
        blocks: list[Block | None] = []
        for i, key in enumerate(keys[:limit] if group.full else keys):
            chunk = tokens[i * block_size:(i + 1) * block_size]
            if group.full:
                block = pool.lookup(group_key(g, key), chunk, blocks[-1] if blocks else None)
                if block is None:
                    break
            else:
                block = pool.lookup(group_key(g, key), chunk, None, any_parent=True)
            blocks.append(block)
        if group.full:
            limit = min(limit, len(blocks))
        found.append(blocks)
    count = limit
    while True:
        before = count
        for g, group in enumerate(groups):
            while count and not group.full and any(
                    found[g][i] is None for i in range(first_seen(group, count, block_size), count)):
                count -= 1
        if checkpoints is not None:
            while count and checkpoints.find(keys[count - 1]) is None:
                count -= 1
        if count == before:
            break
    return [tuple(found[g][i] if i >= first_seen(group, count, block_size) else None
                  for g, group in enumerate(groups)) for i in range(count)]
