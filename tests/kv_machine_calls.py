"""The kv/ calls the state machine (tests/test_kv_state_machine.py) makes, each checked against what it must do:
`allocate_slots`, `computed_blocks` (its prefix hits), `release_behind` and `cache_full_blocks`, per KV group."""
from __future__ import annotations

from hypothesis import event

from hf_paged.kv import NULL_BLOCK, blocks_needed, held, released_prefix
from kv_machine_model import Seq, held_blocks


class KVCalls:
    """Mixed into the machine: reads its `kv`, `pool`, `bs`, `windows`, `content` and `published` (which
    `_publish` extends), and `first_needed` (kv_machine_model.KVInvariants)."""

    def _expected_block(self, seq: Seq, index: int, group: int) -> list:
        return [seq.kv_of(index * self.bs + j, group) for j in range(self.bs)]

    def _allocate(self, seq: Seq, n: int) -> bool:
        """`allocate_slots`, checking that it succeeds exactly when the blocks every group needs (its growth, and a
        private copy of a shared block it is about to write) are free, that a refusal changes nothing and that a
        success covers the new tokens in every group."""
        tables, free, copies = [list(t) for t in seq.block_tables], self.kv.num_free_blocks, len(self.kv._copies)
        total, index = blocks_needed(seq.num_computed_tokens + n, self.bs), seq.num_computed_tokens // self.bs
        need = sum(max(0, total - len(t)) + (index < len(t) and self.pool.blocks[t[index]].ref_count > 1)
                   for t in tables or [[]] * len(self.windows))
        ok = self.kv.allocate_slots(seq, n)
        assert ok == (need <= free), f"allocate_slots({seq}, {n}) = {ok} with {need} blocks needed, {free} free"
        if len(self.kv._copies) > copies:
            event("copy-on-write")
        if not ok:
            assert seq.block_tables == tables and self.kv.num_free_blocks == free and len(self.kv._copies) == copies
            return False
        assert self.kv.num_free_blocks == free - need
        assert len(seq.block_tables) == len(self.windows)
        for table, before in zip(seq.block_tables, tables or [[]] * len(self.windows)):
            assert len(table) * self.bs >= seq.num_computed_tokens + n
            assert table[:index] == before[:index]
        return True

    def _hits_are_right(self, seq: Seq, hits) -> None:
        """One row per hit block, one entry per group: None exactly where a sliding group's window does not see the
        block from the hit point, else a block holding that group's K/V of the sequence's tokens there."""
        count = len(hits)
        assert count * self.bs < seq.num_tokens, "a prefix hit may never cover the last token"
        for i, row in enumerate(hits):
            assert len(row) == len(self.windows), f"hit row {i} has {len(row)} entries for {len(self.windows)} groups"
            for g, block in enumerate(row):
                seen = i >= self.first_needed(g, count * self.bs) // self.bs
                if block is None:
                    assert not seen, f"prefix hit {i} of {count} gives group {g} (window {self.windows[g]}) no block"
                    continue
                assert seen, f"prefix hit {i} of {count} gives group {g} a block its window does not see"
                assert block.block_id != NULL_BLOCK
                assert self.content[block.block_id] == self._expected_block(seq, i, g), \
                    f"prefix hit {i} (block {block.block_id}) does not hold {seq}'s K/V of group {g}"
        if any(block is None for row in hits for block in row):
            event("prefix hit with blocks behind a window")

    def _release_behind(self, seq: Seq, position: int) -> None:
        """`release_behind(seq, position)`, checking per group what went back: in a sliding group of window W, every
        block wholly before `position - W + 1` that is published (the last published one stays: the next to
        publish chains to it; without prefix caching there is no such limit); nothing in a full group."""
        tables = [list(t) for t in seq.block_tables]
        refs = {b: self.pool.blocks[b].ref_count for t in tables for b in held(t)}
        free, gone = self.kv.num_free_blocks, self.kv.release_behind(seq, position)
        dropped = []
        for g, (before, table) in enumerate(zip(tables, seq.block_tables)):
            if self.windows[g] is None:
                assert table == before, f"release_behind changed full group {g}: {before} -> {table}"
                continue
            count = self.first_needed(g, position) // self.bs
            if self.kv.enable_prefix_caching:
                count = min(count, seq.num_published_blocks - 1)
            count = max(count, released_prefix(before))
            assert table == [NULL_BLOCK] * count + before[count:], \
                f"group {g}: release_behind({position}) left {table} of {before}, expected {count} null entries"
            dropped += [b for b in before[:count] if b != NULL_BLOCK]
        assert gone == len(dropped)
        for b in set(dropped):
            assert self.pool.blocks[b].ref_count == refs[b] - dropped.count(b)
        assert self.kv.num_free_blocks == free + sum(1 for b in set(dropped) if self.pool.blocks[b].ref_count == 0)
        if gone:
            event("released blocks behind a window")

    def _publish(self, seq: Seq) -> None:
        before = {b: self.pool.blocks[b].block_hash for b in held_blocks(seq)}
        published = seq.num_published_blocks
        self.kv.cache_full_blocks(seq)
        full = seq.num_computed_tokens // self.bs
        assert seq.num_published_blocks == (max(published, full) if self.kv.enable_prefix_caching else published)
        for g, i in [(g, i) for g in range(len(self.windows)) for i in range(published, seq.num_published_blocks)]:
            b = seq.block_tables[g][i]
            if b == NULL_BLOCK:
                continue
            record = (g, seq.salt, tuple(seq.all_token_ids[:(i + 1) * self.bs]))
            if before[b] is None and self.pool.blocks[b].block_hash is not None:
                self.published[b] = record
                parent = self.pool.blocks[b].parent  # a lookup reaches a block only through its cached parent
                assert parent is None or parent.block_hash is not None, \
                    f"block {b} published under an unfindable parent"
            elif self.pool.blocks[b].block_hash is not None:
                assert self.published[b] == record, f"block {b} is cached for other tokens than {seq} holds there"
