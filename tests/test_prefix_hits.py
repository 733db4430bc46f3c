"""kv/prefix_hits.py: the longest run of leading full blocks that every KV group serves (full groups a chain, sliding
groups only what their window sees from the hit point, state models only up to a checkpoint)."""
from hf_paged.kv import BlockPool
from hf_paged.kv.groups import KVGroup
from hf_paged.kv.hashing import hash_block
from hf_paged.kv.prefix_hits import find_hits, group_key

BLOCK = 4
TOKENS = list(range(100, 112))  # three full blocks
FULL, SLIDING = KVGroup((0,)), KVGroup((1,), window=4)


def chain_keys(tokens):
    keys, parent = [], None
    for i in range(0, len(tokens), BLOCK):
        parent = hash_block(parent, tokens[i:i + BLOCK], None)
        keys.append(parent)
    return keys


def cached_pool(groups_blocks):
    """A pool where group g caches the blocks at indices groups_blocks[g] of TOKENS (a chain within each group)."""
    pool, keys = BlockPool(16), chain_keys(TOKENS)
    for g, indices in enumerate(groups_blocks):
        parent = None
        for i in indices:
            (block_id,) = pool.allocate(1)
            pool.cache(block_id, group_key(g, keys[i]), TOKENS[i * BLOCK:(i + 1) * BLOCK], parent)
            parent = pool.blocks[block_id]
    return pool, keys


def test_group_keys_differ_per_group_and_group_0_keeps_the_chain_key():
    key = chain_keys(TOKENS)[0]
    assert group_key(0, key) == key and len({group_key(g, key) for g in range(3)}) == 3


def test_a_full_group_hits_the_cached_chain_and_stops_at_the_first_different_block():
    pool, keys = cached_pool([[0, 1, 2]])
    hits = find_hits(pool, (FULL,), BLOCK, keys, TOKENS)
    assert [row[0].block_id for row in hits] == [1, 2, 3]
    other = TOKENS[:8] + [0, 0, 0, 0]
    assert len(find_hits(pool, (FULL,), BLOCK, chain_keys(other), other)) == 2


def test_a_sliding_group_needs_only_the_blocks_its_window_sees():
    pool, keys = cached_pool([[0, 1, 2], [2]])
    hits = find_hits(pool, (FULL, SLIDING), BLOCK, keys, TOKENS)
    assert len(hits) == 3 and [row[1] is None for row in hits] == [True, True, False]
    pool, keys = cached_pool([[0, 1, 2], []])  # the sliding group holds nothing: no hit at all
    assert find_hits(pool, (FULL, SLIDING), BLOCK, keys, TOKENS) == []


def test_with_checkpoints_the_hit_ends_at_a_checkpointed_block():
    pool, keys = cached_pool([[0, 1, 2]])

    class Checkpoints:
        def find(self, key):
            return "state" if key == keys[0] else None

    assert len(find_hits(pool, (FULL,), BLOCK, keys, TOKENS, Checkpoints())) == 1
