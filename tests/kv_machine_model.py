"""The model half of the kv/ state machine (tests/test_kv_state_machine.py): what a sequence is and holds, and the
invariants checked after every rule — reference counts and the free queue, the prefix map, every computed token's K/V
really in each KV group's table, the swap pool. The rules that drive kv/ the way the scheduler does live in the test.

The machine's manager has one or more KV groups (`windows[g]`: group g's sliding window in tokens, None: full
attention). Every group has a table of its own per sequence, all drawing from one pool; a token's K/V in group g is
`Seq.kv_of(position, g)`, tagged with the group, so a block that moves to (or is found for) the wrong group shows."""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event
from hypothesis.stateful import invariant

from hf_paged.engine.scheduler import RELEASED
from hf_paged.kv import NULL_BLOCK, blocks_needed, held, released_prefix
from hf_paged.kv import manager as kv_manager  # its hash_block: the colliding-keys variant patches it

GARBAGE, ZERO, NAN = "garbage", "zero", "nan"
MAX_SEQS = 6  # sequences the machine keeps at once (running, waiting or swapped)


@dataclass(eq=False)
class Seq:
    """A sequence with the fields of `hf_paged.kv.manager.BlockHolder` plus the machine's own bookkeeping."""

    name: int
    all_token_ids: list[int]
    prompt_len: int
    salt: str | None
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV group; [] while holding nothing
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    stale_kv: bool = False
    num_computed_tokens: int = 0
    status: str = "waiting"  # waiting (new or preempted by recompute) | running | swapped
    host: list[int] = field(default_factory=list)  # while swapped: each group's entries in turn (RELEASED: not saved)
    state_slot: int = -1  # its slot in the manager's StateSlots while running (a model with state layers)
    swapped_state: dict | None = None  # its state in host memory while swapped (`StateSlots.save`)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len

    @property
    def cache_salt(self) -> str | None:
        return self.salt

    def kv_of(self, position: int, group: int):
        """What group `group`'s K/V slot of token `position` holds once computed for this sequence."""
        return (group, self.salt, tuple(self.all_token_ids[:position + 1]))

    def state_after(self, count: int) -> tuple:
        """What a state layer's state holds once it has seen this sequence's first `count` tokens."""
        return (self.salt, tuple(self.all_token_ids[:count]))

    def snapshot(self) -> tuple:
        """Every field a step may change (`Request.snapshot`): a failed step puts them back (`restore`)."""
        return (self.status, self.num_computed_tokens, [list(t) for t in self.block_tables], len(self.all_token_ids),
                len(self.block_hashes), self.num_published_blocks, list(self.host), self.state_slot,
                self.swapped_state, self.stale_kv)

    def restore(self, saved: tuple) -> None:
        (self.status, self.num_computed_tokens, self.block_tables, num_tokens, num_hashes, self.num_published_blocks,
         self.host, self.state_slot, self.swapped_state, self.stale_kv) = saved
        del self.all_token_ids[num_tokens:]
        del self.block_hashes[num_hashes:]

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints draws with this
        printer.text(repr(self))

    def __repr__(self) -> str:
        return (f"Seq{self.name}({self.status}, salt={self.salt!r}, tokens={self.all_token_ids}, "
                f"computed={self.num_computed_tokens}, published={self.num_published_blocks}, "
                f"tables={self.block_tables}, host={self.host}, state_slot={self.state_slot})")


def chain_keys(tokens, salt, block_size: int, count: int) -> list[bytes]:
    keys: list[bytes] = []
    for i in range(count):
        keys.append(kv_manager.hash_block(keys[-1] if keys else None, tokens[i * block_size:(i + 1) * block_size], salt))
    return keys


def group_key(group: int, key: bytes) -> bytes:
    """Group `group`'s prefix-map key for chain key `key` (written out here, not taken from kv/)."""
    return key if group == 0 else key + group.to_bytes(2, "little")


class KVInvariants:
    """Mixed into the machine: reads its `kv`, `pool`, `swap`, `seqs`, `content`, `published`, `bs`, `windows`,
    `swap_in` and `exact_hash`."""

    def first_needed(self, group: int, position: int) -> int:
        """The first slot group `group` reads for a query at `position` (its window's start; 0: full attention)."""
        window = self.windows[group]
        return 0 if window is None else max(position - window + 1, 0)

    def _check_common_prefixes(self) -> None:
        """`common_prefix_blocks` (the scheduler asks it every schedule) against the tokens, for every pair."""
        for a in self.seqs:
            for b in self.seqs:
                if a is b:
                    continue
                expected = 0
                if a.salt == b.salt:
                    limit = min(a.prompt_len, b.prompt_len) // self.bs
                    while expected < limit and a.all_token_ids[:(expected + 1) * self.bs] == \
                            b.all_token_ids[:(expected + 1) * self.bs]:
                        expected += 1
                got = self.kv.common_prefix_blocks(a, b)
                if self.exact_hash:
                    assert got == expected, f"common_prefix_blocks({a}, {b}) = {got}, expected {expected}"
                else:
                    assert got >= expected  # a colliding hash can only claim more (it is only a scheduling hint)

    # ---- invariants ----------------------------------------------------------------------------------------------
    @invariant()
    def bookkeeping(self):
        pool, blocks = self.pool, self.pool.blocks
        holders: dict[int, list[Seq]] = {}
        for seq in self.seqs:
            if seq.status != "running":
                assert seq.block_tables == [], f"{seq} holds device blocks"
                continue
            assert len(seq.block_tables) == len(self.windows), f"{seq}: not one table per group"
            mine: list[int] = []
            for g, table in enumerate(seq.block_tables):
                released = released_prefix(table)  # given back behind a sliding window, or a hit it no longer sees
                assert NULL_BLOCK not in table[released:], f"{seq}: group {g}'s null entries are not a leading run"
                assert released == 0 or self.windows[g] is not None, f"{seq}: full group {g} holds the null block"
                mine += table[released:]
            assert len(set(mine)) == len(mine), f"{seq} holds a block twice (in one table or in two groups)"
            for b in mine:
                holders.setdefault(b, []).append(seq)
        assert blocks[NULL_BLOCK].ref_count == 0
        assert self.content[NULL_BLOCK] == [ZERO] * self.bs, "the null block was written"
        for block in blocks[1:]:
            assert block.ref_count == len(holders.get(block.block_id, [])), \
                f"block {block.block_id}: ref_count {block.ref_count}, held by {holders.get(block.block_id)}"
        # walk the free queue both ways
        free, node = [], pool.free_queue._head.next
        while node is not pool.free_queue._tail:
            assert node.next.prev is node
            free.append(node.block_id)
            node = node.next
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert NULL_BLOCK not in free
        assert set(free) == {b.block_id for b in blocks[1:] if b.ref_count == 0}
        assert pool.num_free_blocks + len(holders) == pool.num_blocks
        # every holder of a block has the same salt: prefix hits never cross salts (forks keep the salt)
        for b, seqs in holders.items():
            assert len({s.salt for s in seqs}) == 1, f"block {b} shared across salts: {seqs}"

    @invariant()
    def prefix_map(self):
        for key, block in self.pool.cached.items():
            assert block.block_hash == key and block.block_id != NULL_BLOCK
            group, salt, tokens = self.published[block.block_id]
            assert len(tokens) % self.bs == 0
            assert block.token_ids == tuple(tokens[-self.bs:])
            assert key == group_key(group, chain_keys(list(tokens), salt, self.bs, len(tokens) // self.bs)[-1]), \
                f"block {block.block_id} is cached under another key than group {group}'s for its tokens"
            start = len(tokens) - self.bs
            assert self.content[block.block_id] == [(group, salt, tokens[:start + j + 1]) for j in range(self.bs)], \
                f"cached block {block.block_id} does not hold what it is cached for"
            parent = block.parent
            assert parent is None or parent.block_id != NULL_BLOCK, f"block {block.block_id} chained to the null block"
            if parent is not None and parent.generation == block.parent_generation and parent.block_hash is not None:
                assert self.published[parent.block_id] == (group, salt, tokens[:start])
            if parent is None:
                assert start == 0  # a block after a released (null) entry is never published
        for block in self.pool.blocks:
            if block.block_hash is not None:
                assert self.pool.cached.get(block.block_hash) is block

    @invariant()
    def sequences(self):
        arriving = {id(seq) for _, _, seq in self.swap_in}
        copying = {dst for _, dst in self.kv._copies}  # copy-on-write destinations filled by this step's moves
        for seq in self.seqs:
            keys = seq.block_hashes
            assert len(keys) <= seq.num_tokens // self.bs
            assert keys == chain_keys(seq.all_token_ids, seq.salt, self.bs, len(keys))
            computed = seq.num_computed_tokens
            assert 0 <= computed <= seq.num_tokens
            if seq.status == "running":
                assert seq.num_published_blocks <= computed // self.bs
                for g, table in enumerate(seq.block_tables):
                    assert len(table) >= blocks_needed(computed, self.bs)
                    # a query at `computed` reads every slot from its window's start: those blocks must be held
                    assert released_prefix(table) <= self.first_needed(g, computed) // self.bs, \
                        f"{seq}: group {g} gave back a block its window still sees"
                if id(seq) in arriving:
                    continue  # its K/V come back from host memory in this step's block moves
                for g, table in enumerate(seq.block_tables):
                    seen = self.first_needed(g, computed)
                    # every held slot: those the window sees are read, those behind it may still be published
                    for p in range(released_prefix(table) * self.bs, computed):
                        b = table[p // self.bs]
                        if b in copying:
                            continue
                        assert self.content[b][p % self.bs] == seq.kv_of(p, g), \
                            f"{seq}: group {g}'s token {p} in block {b} holds {self.content[b][p % self.bs]}" + \
                            ("" if p >= seen else " (behind its window)")
            elif seq.status == "swapped":
                per_group = blocks_needed(computed, self.bs)
                assert len(seq.host) == per_group * len(self.windows)
                for g in range(len(self.windows)):
                    entries = seq.host[g * per_group:(g + 1) * per_group]
                    kept = [h for h in entries if h != RELEASED]
                    assert entries == [RELEASED] * (per_group - len(kept)) + kept
                    assert per_group - len(kept) <= self.first_needed(g, computed) // self.bs
            else:
                assert computed == 0 and not seq.host and not seq.block_tables

    @invariant()
    def bounded(self):
        """No running sequence holds more blocks in a group at once than `group_bound` says (what admission and
        swap-in ask room for): every block in a full group; in a releasing group, with `max_chunk` set, the window's,
        one step's chunk, one partly covered and the last published one (the scheduler releases before each chunk)."""
        for seq in self.seqs:
            if seq.status == "running":
                for g, table in enumerate(seq.block_tables):
                    bound = self.kv.group_bound(g, seq.num_tokens)
                    assert len(held(table)) <= bound, f"{seq}: group {g} holds {len(held(table))} blocks, bound {bound}"
                    if len(held(table)) == bound < blocks_needed(seq.num_tokens, self.bs):
                        event("a releasing group holds as many blocks as its bound")

    @invariant()
    def swap_pool(self):
        held_ids = [h for s in self.seqs for h in s.host if h != RELEASED]
        held_ids += [h for host, _, _ in self.swap_in for h in host]
        free = self.swap.free_ids
        assert len(set(held_ids)) == len(held_ids) and len(set(free)) == len(free)
        assert not set(held_ids) & set(free)
        assert self.swap.num_free + len(held_ids) == self.swap.num_blocks


def held_blocks(seq: Seq) -> list[int]:
    """Every block `seq` holds, over all its groups' tables."""
    return [b for table in seq.block_tables for b in held(table)]
