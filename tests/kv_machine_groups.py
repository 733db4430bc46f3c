"""KV group layouts for the kv state machine (tests/test_kv_state_machine.py), and the scheduler's own handling of
every group's table that the machine mirrors: swap out and swap in, exactly as `Scheduler._preempt` and
`Scheduler._swap_in` do (the machine drives kv/ with sequences of its own, not the scheduler)."""
from __future__ import annotations

from hypothesis import strategies as st

from hf_paged.engine.scheduler import RELEASED
from hf_paged.kv import NULL_BLOCK, blocks_needed, released_prefix
from hf_paged.kv.groups import KVGroup


def layouts(block_size: int, exact_hash: bool) -> st.SearchStrategy[tuple[int | None, ...]]:
    """Each group's sliding window in tokens (None: full attention), with windows of 1 to 3 blocks' worth of tokens:
    one full group (a model without sliding layers), full + sliding mixes, or sliding groups only. With colliding
    block keys only full groups: a sliding group's hit takes the keyed chain hash's word for the prefix
    (`BlockPool.lookup(any_parent=True)`), so a key that forgets the prefix would serve wrong K/V by design."""
    if not exact_hash:
        return st.integers(1, 3).map(lambda n: (None,) * n)
    window = st.integers(1, 3 * block_size)
    mixes = st.one_of(
        st.tuples(st.none(), window),
        st.tuples(window, st.none(), window),
        st.lists(st.one_of(st.none(), window), min_size=1, max_size=3).map(tuple),
    )
    return st.sampled_from(["mix", "mix", "mix", "one full group"]).flatmap(
        lambda kind: st.just((None,)) if kind == "one full group" else mixes)


def kv_groups(windows: tuple[int | None, ...]) -> tuple[KVGroup, ...]:
    """One layer per group (layer g in group g)."""
    return tuple(KVGroup((g,), window) for g, window in enumerate(windows))


# ---- Scheduler._preempt / Scheduler._swap_in, per group ----------------------------------------------------------
def saved_blocks(tables: list[list[int]], num_computed_tokens: int, block_size: int) -> tuple[list[int], list[int]]:
    """What a swap-out saves: every group's blocks holding computed tokens, group after group, without the leading
    entries a window gave back (the null block); and that released count per group."""
    computed = blocks_needed(num_computed_tokens, block_size)
    released = [released_prefix(table[:computed]) for table in tables]
    device = [b for table, gone in zip(tables, released) for b in table[gone:computed]]
    return device, released


def swapped_layout(host: list[int], released: list[int], num_computed_tokens: int, block_size: int) -> list[int]:
    """`swapped_blocks`: each group's `computed` entries in turn, RELEASED for the ones not saved."""
    computed = blocks_needed(num_computed_tokens, block_size)
    swapped, at = [], 0
    for gone in released:
        swapped += [RELEASED] * gone + host[at:at + computed - gone]
        at += computed - gone
    return swapped


def swap_in_room(kv, swapped: list[int], num_tokens: int, num_computed_tokens: int, num_new: int) -> int:
    """The free blocks a swap-in asks for: what comes back plus its first `num_new` tokens, or, if more, in each group
    the most the request holds at once (`group_bound`) or what it holds already."""
    per_group = len(swapped) // kv.num_groups
    kept = [sum(h != RELEASED for h in swapped[g * per_group:(g + 1) * per_group]) for g in range(kv.num_groups)]
    first = sum(kept) + kv.num_groups * max(blocks_needed(num_computed_tokens + num_new, kv.block_size) - per_group, 0)
    return max(first, sum(max(kv.group_bound(g, num_tokens), kept[g]) for g in range(kv.num_groups)))


def swapped_in_tables(swapped: list[int], device: list[int], num_groups: int) -> list[list[int]]:
    """The tables a swap-in rebuilds: `device` (one block per saved entry, in order) in place of the host blocks,
    the null block where a window had given the block back."""
    per_group, handed = len(swapped) // num_groups, iter(device)
    if not per_group:
        return []
    return [[NULL_BLOCK if h == RELEASED else next(handed) for h in swapped[g:g + per_group]]
            for g in range(0, len(swapped), per_group)]
