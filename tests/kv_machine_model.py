"""The model half of the kv/ state machine (tests/test_kv_state_machine.py): what a sequence is and holds, and the
invariants checked after every rule — reference counts and the free queue, the prefix map, every computed token's K/V
really in its table's blocks, the swap pool. The rules that drive kv/ the way the scheduler does live in the test."""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis.stateful import invariant

from hf_paged.engine.scheduler import RELEASED
from hf_paged.kv import NULL_BLOCK, blocks_needed, released_prefix
from hf_paged.kv import manager as kv_manager  # its hash_block: the colliding-keys variant patches it

GARBAGE, ZERO, NAN = "garbage", "zero", "nan"


@dataclass(eq=False)
class Seq:
    """A sequence with the fields of `hf_paged.kv.manager.Sequence` plus the machine's own bookkeeping."""

    name: int
    all_token_ids: list[int]
    prompt_len: int
    salt: str | None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    stale_kv: bool = False
    num_computed_tokens: int = 0
    status: str = "waiting"  # waiting (new or preempted by recompute) | running | swapped
    host: list[int] = field(default_factory=list)  # swap blocks while swapped

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len

    @property
    def cache_salt(self) -> str | None:
        return self.salt

    def kv_of(self, position: int):
        """What the K/V slot of token `position` holds once computed for this sequence."""
        return (self.salt, tuple(self.all_token_ids[:position + 1]))

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints draws with this
        printer.text(repr(self))

    def __repr__(self) -> str:
        return (f"Seq{self.name}({self.status}, salt={self.salt!r}, tokens={self.all_token_ids}, "
                f"computed={self.num_computed_tokens}, table={self.block_table}, host={self.host})")


def chain_keys(tokens, salt, block_size: int, count: int) -> list[bytes]:
    keys: list[bytes] = []
    for i in range(count):
        keys.append(kv_manager.hash_block(keys[-1] if keys else None, tokens[i * block_size:(i + 1) * block_size], salt))
    return keys


class KVInvariants:
    """Mixed into the machine: reads its `kv`, `pool`, `swap`, `seqs`, `content`, `published`, `bs`, `swap_in` and
    `exact_hash`."""

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
                assert seq.block_table == [], f"{seq} holds device blocks"
            released = released_prefix(seq.block_table)  # given back behind a sliding window: a leading run
            assert NULL_BLOCK not in seq.block_table[released:]
            for b in seq.block_table[released:]:
                holders.setdefault(b, []).append(seq)
        assert blocks[NULL_BLOCK].ref_count == 0
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
            salt, tokens = self.published[block.block_id]
            assert len(tokens) % self.bs == 0
            assert block.token_ids == tuple(tokens[-self.bs:])
            assert key == chain_keys(list(tokens), salt, self.bs, len(tokens) // self.bs)[-1]
            start = len(tokens) - self.bs
            assert self.content[block.block_id] == [(salt, tokens[:start + j + 1]) for j in range(self.bs)], \
                f"cached block {block.block_id} does not hold what it is cached for"
            parent = block.parent
            assert parent is None or parent.block_id != NULL_BLOCK, f"block {block.block_id} chained to the null block"
            if parent is not None and parent.generation == block.parent_generation and parent.block_hash is not None:
                assert self.published[parent.block_id] == (salt, tokens[:start])
            if parent is None:
                assert start == 0
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
            assert 0 <= seq.num_computed_tokens <= seq.num_tokens
            if seq.status == "running":
                assert len(seq.block_table) >= blocks_needed(seq.num_computed_tokens, self.bs)
                assert seq.num_published_blocks <= seq.num_computed_tokens // self.bs
                if id(seq) in arriving:
                    continue  # its K/V come back from host memory in this step's block moves
                for p in range(released_prefix(seq.block_table) * self.bs, seq.num_computed_tokens):
                    b = seq.block_table[p // self.bs]
                    if b in copying:
                        continue
                    assert self.content[b][p % self.bs] == seq.kv_of(p), \
                        f"{seq}: token {p} in block {b} holds {self.content[b][p % self.bs]}"
            elif seq.status == "swapped":
                assert len(seq.host) == blocks_needed(seq.num_computed_tokens, self.bs)
            else:
                assert seq.num_computed_tokens == 0 and not seq.host

    @invariant()
    def swap_pool(self):
        held = [h for s in self.seqs for h in s.host if h != RELEASED] + [h for host, _, _ in self.swap_in for h in host]
        free = self.swap.free_ids
        assert len(set(held)) == len(held) and len(set(free)) == len(free)
        assert not set(held) & set(free)
        assert self.swap.num_free + len(held) == self.swap.num_blocks
