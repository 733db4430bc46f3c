"""The step of the kv state machine (tests/test_kv_state_machine.py) besides its forward: the block moves
(KVMemory.apply), Scheduler.update (forks, a non-finite row, finishing) and a failed step undone the way
`StepUndo` undoes it (the manager, the swap space and every sequence put back; device memory not: the sequences that
may have lost what they hold there are recomputed)."""
from __future__ import annotations

from hypothesis import event, strategies as st

from hf_paged.engine.scheduler import RELEASED
from hf_paged.kv import NULL_BLOCK
from kv_machine_model import GARBAGE, MAX_SEQS, NAN, ZERO, Seq, held_blocks


class KVStep:
    """Mixed into the machine: reads and changes its `kv`, `pool`, `swap`, `seqs`, `content`, `host_content`,
    `published`, `written`, `plan`, `swap_out`, `swap_in` and `in_step`."""

    # A failed step's forward may have written non-finite values (its K/V past the computed tokens, its states and
    # checkpoints): the rollback must distrust all of it. Off by default: with it the machine finds such values left
    # in blocks that survive the rollback (see test_kv_machine_findings.py).
    failed_writes_nan = False

    # ---- all or nothing (StepUndo) ----------------------------------------------------------------------------
    def _begin_step(self) -> None:
        """StepUndo.begin, before the schedule's first change: what a rollback puts back."""
        if self.in_step:
            return
        self.in_step = True
        self._undo = (list(self.seqs), {seq.name: seq.snapshot() for seq in self.seqs}, dict(self.published))
        self.kv.begin()
        self.swap.begin()

    def _commit(self) -> None:
        self.kv.commit()
        self.swap.commit()
        self.in_step, self._undo = False, None

    def _fail(self, where: str) -> None:
        """StepUndo.rollback: the sequences (and which exist), the swap space and the manager (pool, state slot ids,
        checkpoint keys) as they were at `begin`; then, since device memory is not put back, every running sequence's
        next block is distrusted, and those holding a state slot (written in place by the forward) or a block handed
        out in the step are recomputed (`Scheduler.recompute`)."""
        event(f"a step failed in its {where}")
        if self.failed_writes_nan and where in ("forward", "update"):
            for b, j in {slot for slots in self.written.values() for slot in slots}:
                self.content[b][j] = NAN
            self._failed_states_nan()
        seqs, saved, published = self._undo
        self.seqs, self.published = seqs, published
        for seq in seqs:
            seq.restore(saved[seq.name])
        self.swap.rollback()
        written = self.kv.rollback()
        self._new_plan()
        self.in_step, self._undo = False, None
        for seq in self._with("running"):  # StepUndo._distrust
            self.kv.distrust_tail(seq)
            if (seq.state_slot >= 0 and seq.num_computed_tokens) or \
                    any(b in written for table in seq.block_tables for b in table):
                self.kv.free(seq)
                assert seq.block_tables == [] and seq.state_slot == -1
                seq.num_computed_tokens, seq.status = 0, "waiting"
                event("recomputed after a failed step")

    # ---- the block moves (KVMemory.apply) ---------------------------------------------------------------------
    def _moves(self) -> None:
        """Swap-outs, then copy-on-write copies before clearing (a copy's source freed and handed out again in this
        step may be cleared; a copy's destination is not cleared: the copy fills it whole), then swap-ins."""
        for device_ids, host_ids in self.swap_out:
            for d, h in zip(device_ids, host_ids):
                self.host_content[h] = list(self.content[d])
        cleared, copies = self.kv.take_blocks_to_clear(), self.kv.take_copies()
        assert NULL_BLOCK not in cleared
        for src, dst in copies:
            assert NULL_BLOCK not in (src, dst) and src != dst
            self.content[dst] = list(self.content[src])
        if set(cleared) & {src for src, _ in copies}:
            event("a copy-on-write source handed out again and cleared in the same step")
        for b in set(cleared) - {dst for _, dst in copies}:
            self.content[b] = [ZERO] * self.bs
        swap_in, self.swap_in = self.swap_in, []
        for host_ids, device_ids, _ in swap_in:
            for h, d in zip(host_ids, device_ids):
                self.content[d] = list(self.host_content[h])
            self.swap.free(host_ids)

    # ---- the forward's K/V --------------------------------------------------------------------------------------
    def _write_kv(self) -> None:
        """Every planned sequence writes its new tokens' K/V in every group (before any attention reads). Nothing a
        planned sequence holds may be uninitialised or NaN when the forward reads it, masked slots too, but for the
        slots this forward writes first."""
        self.written = {}
        for seq, n in self.plan:
            start = seq.num_computed_tokens
            for g, table in enumerate(seq.block_tables):  # every group computes every token's K/V
                assert len(table) * self.bs >= start + n
                for p in range(start, start + n):
                    b = table[p // self.bs]
                    assert b != NULL_BLOCK, f"{seq} writes group {g}'s token {p} into the null block"
                    self.written.setdefault(seq.name, set()).add((b, p % self.bs))
        overwritten = {slot for slots in self.written.values() for slot in slots}
        for seq, _ in self.plan:
            for b in held_blocks(seq):
                assert not any(self.content[b][j] in (GARBAGE, NAN) and (b, j) not in overwritten
                               for j in range(self.bs)), f"{seq} holds block {b} = {self.content[b]} in a forward pass"
        for seq, n in self.plan:
            start = seq.num_computed_tokens
            for g, table in enumerate(seq.block_tables):
                for p in range(start, start + n):
                    b = table[p // self.bs]
                    block = self.pool.blocks[b]
                    assert block.ref_count == 1, f"{seq} writes token {p} into block {b} shared by {block.ref_count}"
                    assert block.block_hash is None, f"{seq} writes into block {b}, which is in the prefix map"
                    self.content[b][p % self.bs] = seq.kv_of(p, g)

    # ---- update: right after the forward, then between steps ---------------------------------------------------
    def _fork(self, parent: Seq) -> Seq:
        """Another sample starts from `parent`'s just-computed tokens (Scheduler._start_fork)."""
        self.names += 1
        child = Seq(self.names, list(parent.all_token_ids), parent.prompt_len, parent.salt)
        shared = held_blocks(parent)
        refs = [self.pool.blocks[b].ref_count for b in shared]
        self.kv.fork(parent, child)
        assert child.block_tables == parent.block_tables
        assert not any(c is p for c in child.block_tables for p in parent.block_tables)
        assert [self.pool.blocks[b].ref_count for b in shared] == [r + 1 for r in refs]
        assert child.num_published_blocks == parent.num_published_blocks
        assert child.state_slot == -1 if self.kv.states is None else -1 < child.state_slot != parent.state_slot
        child.num_computed_tokens, child.status = parent.num_computed_tokens, "running"
        if child.state_slot >= 0:
            event("a fork copies a state")
        self.seqs.append(child)
        return child

    def _release(self, seq: Seq) -> None:
        self.kv.free(seq)
        assert seq.block_tables == [] and seq.num_published_blocks == 0 and seq.state_slot == -1
        if seq.host:
            self.swap.free([h for h in seq.host if h != RELEASED])
            seq.host = []
        seq.swapped_state = None
        self.seqs.remove(seq)

    def _update(self, completed: list[Seq], data, failing: bool) -> None:
        """Scheduler.update: each sequence the step completed samples from its logits row. More samples may fork
        from it first (n > 1: they share that row); then a non-finite row ends all of them and discards their K/V,
        or each gets its next token or finishes. (In a step that is to fail, what the non-finite pass wrote is NaN
        only with `failed_writes_nan`.)"""
        for parent in completed:
            row = [parent]
            room = MAX_SEQS - len(self.seqs)
            if room and data.draw(st.booleans(), label=f"fork Seq{parent.name}"):
                event("fork")
                row += [self._fork(parent) for _ in range(data.draw(st.integers(1, room), label="children"))]
            if data.draw(st.integers(0, 11), label="row outcome") == 0:
                event("non-finite")
                if self.failed_writes_nan or not failing:
                    for b, j in self.written.get(parent.name, ()):
                        self.content[b][j] = NAN  # what the pass wrote may be NaN (only this row holds it)
                    self._non_finite_states(parent, row)
                for seq in row:
                    self.kv.discard_contents(seq)
                    assert all(self.pool.blocks[b].block_hash is None for b in held_blocks(seq))
                    self._release(seq)
                continue
            for seq in row:
                token = data.draw(st.integers(0, 11), label=f"token for Seq{seq.name}")
                if token == 0:
                    self._release(seq)  # it stopped
                else:
                    seq.all_token_ids.append(1 + token % 2)
