"""A stateful (hypothesis) model of hf_paged.kv, driven the way the scheduler drives it.

The machine keeps a small pool (6-12 blocks of 2-4 tokens) and a few sequences, and steps like the engine does:
a *schedule* phase (running sequences grow with `allocate_slots`; running sequences are preempted by recompute or
by swap; then, only if nothing was preempted, waiting sequences are admitted from their prefix hits and swapped
sequences come back with `allocate_blocks`), then a *step* that applies the block moves in the engine's order
(swap out, clear, copy-on-write copies, swap in) and writes the scheduled tokens, then *update* rules between steps
(sample a token, fork, finish / abort, a non-finite error that discards the contents).

Besides the bookkeeping (reference counts, free queue, prefix map, swap pool), the machine models what every
block *holds*: each slot is GARBAGE (never written, as torch.empty), ZERO (cleared), NAN (written by a forward pass
that went non-finite) or the K/V of one token, named by (cache salt, all tokens up to and including it). So it
checks end to end that a sequence's computed tokens are really in its table's blocks, whatever prefix hits,
copy-on-write, swaps and block reuse happened, and that no block a sequence holds ever holds garbage or NaN.
"""
from __future__ import annotations

from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import torch

from hf_paged.engine.scheduler import RELEASED
from hf_paged.kv import NULL_BLOCK, KVCache, KVCacheManager, KVCacheSpec, blocks_needed, released_prefix
from hf_paged.kv.swap import SwapPool
from kv_machine_model import GARBAGE, NAN, ZERO, KVInvariants, Seq

SALTS = (None, "a", "b")
MAX_SEQS = 6


class KVMachine(KVInvariants, RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.seqs: list[Seq] = []
        self.names = 0
        self.completed: list[Seq] = []  # sequences whose tokens the last step completed: they sample in `update`
        self.updating = False  # between `step` and `update` nothing else happens (Scheduler.update follows the pass)
        self._new_plan()

    def _new_plan(self) -> None:
        self.plan: list[list] = []  # [seq, num_new_tokens]
        self.swap_out: list[tuple[list[int], list[int]]] = []  # (device ids, host ids)
        self.swap_in: list[tuple[list[int], list[int], Seq]] = []  # (host ids, device ids, seq)
        self.preempted = False
        self.admitting = False  # the scheduler admits after its running loop: no preemption nor growth after that
        self.considered: set[int] = set()  # running sequences the running loop has looked at (placed or not)

    exact_hash = True  # False in the variant whose block keys collide on purpose (see test_colliding_keys)

    @initialize(num_blocks=st.integers(4, 10), block_size=st.integers(2, 4), swap_blocks=st.integers(1, 6))
    def setup(self, num_blocks, block_size, swap_blocks):
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size)
        self.pool = self.kv.pool
        spec = KVCacheSpec(1, 1, 2, torch.float32, torch.device("cpu"))
        self.swap = SwapPool(KVCache(spec, num_blocks + 1, block_size), swap_blocks)
        self.content = {b: [GARBAGE] * block_size for b in range(1, num_blocks + 1)}
        self.content[NULL_BLOCK] = [ZERO] * block_size
        self.host_content: dict[int, list] = {h: [GARBAGE] * block_size for h in range(swap_blocks)}
        self.published: dict[int, tuple] = {}  # block id -> (salt, every token up to the block's end) it was cached for
        self.written: dict[int, set[int]] = {}  # seq name -> blocks its last forward pass wrote

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _with(self, status: str, pred=lambda s: True) -> list[Seq]:
        return [s for s in self.seqs if s.status == status and pred(s)]

    @property
    def idle(self) -> bool:
        """Between steps, with nothing scheduled yet (where aborts happen)."""
        return not (self.updating or self.plan or self.swap_out or self.swap_in or self.preempted or self.admitting)

    @property
    def may_grow(self) -> bool:
        """In the scheduler's running loop (it comes before admission)."""
        return not (self.updating or self.admitting)

    @property
    def may_admit(self) -> bool:
        """Scheduler._admit runs after the running loop looked at every running sequence, and only when it
        preempted none."""
        return not (self.updating or self.preempted or self._growable())

    def _planned(self, seq: Seq) -> bool:
        return any(entry[0] is seq for entry in self.plan)

    def _unplan(self, seq: Seq) -> None:
        self.plan = [entry for entry in self.plan if entry[0] is not seq]

    def _expected_block(self, seq: Seq, index: int) -> list:
        return [seq.kv_of(index * self.bs + j) for j in range(self.bs)]

    def _allocate(self, seq: Seq, n: int) -> bool:
        """`allocate_slots`, checking that a refusal changes nothing and a success covers the new tokens."""
        table, free, copies = list(seq.block_table), self.kv.num_free_blocks, len(self.kv._copies)
        ok = self.kv.allocate_slots(seq, n)
        if len(self.kv._copies) > copies:
            event("copy-on-write")
        if not ok:
            assert seq.block_table == table and self.kv.num_free_blocks == free and len(self.kv._copies) == copies
            return False
        assert len(seq.block_table) * self.bs >= seq.num_computed_tokens + n
        assert seq.block_table[:seq.num_computed_tokens // self.bs] == table[:seq.num_computed_tokens // self.bs]
        return True

    def _hits_are_right(self, seq: Seq, hits) -> None:
        assert len(hits) * self.bs < seq.num_tokens, "a prefix hit may never cover the last token"
        for i, block in enumerate(hits):
            assert block.block_id != NULL_BLOCK
            assert self.content[block.block_id] == self._expected_block(seq, i), \
                f"prefix hit {i} (block {block.block_id}) does not hold {seq}'s K/V"

    # ---- schedule: the running loop ---------------------------------------------------------------------------
    def _growable(self) -> list[Seq]:
        return self._with("running", lambda s: s.num_computed_tokens < s.num_tokens and s.name not in self.considered)

    @precondition(lambda self: self.may_grow and self._growable())
    @rule(data=st.data())
    def grow(self, data):
        """A running sequence gets slots for its next chunk (copy-on-write of a shared block included)."""
        seq = data.draw(st.sampled_from(self._growable()), label="seq")
        self.considered.add(seq.name)
        n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens), label="n")
        if self._allocate(seq, n):
            self.plan.append([seq, n])

    def _preemptable(self) -> list[Seq]:
        return self._with("running", lambda s: s.num_computed_tokens < s.num_tokens)

    def _swappable(self) -> list[Seq]:
        return [s for s in self._preemptable()
                if 0 < blocks_needed(s.num_computed_tokens, self.bs) - released_prefix(s.block_table) <= self.swap.num_free]

    def _preempt_recompute(self, seq: Seq) -> None:
        self._unplan(seq)
        self.kv.free(seq)
        assert seq.block_table == [] and seq.num_published_blocks == 0
        seq.num_computed_tokens, seq.status = 0, "waiting"
        self.preempted = True

    def _preempt_swap(self, seq: Seq) -> None:
        computed = blocks_needed(seq.num_computed_tokens, self.bs)
        released = released_prefix(seq.block_table)
        event("swap out" + (" behind released blocks" if released else ""))
        if set(seq.block_table[:computed]) & {dst for _, dst in self.kv._copies}:
            event("swap out of a block whose copy-on-write is pending")
        host = self.swap.allocate(computed - released)
        assert len(set(host)) == computed - released
        # exactly what Scheduler._preempt records: a block given a private copy in this step is saved from its source;
        # blocks a sliding window gave back (the null block) are not saved
        self.swap_out.append((self.kv.current_contents(seq.block_table[released:computed]), host))
        self._unplan(seq)
        self.kv.free(seq)
        seq.host, seq.status = [RELEASED] * released + host, "swapped"
        self.preempted = True

    def _preempt(self, victim: Seq, data) -> None:
        if victim in self._swappable() and data.draw(st.booleans(), label=f"swap Seq{victim.name} out"):
            self._preempt_swap(victim)
        else:
            self._preempt_recompute(victim)

    @precondition(lambda self: self.may_grow and self._preemptable())
    @rule(data=st.data())
    def preempt(self, data):
        """A running sequence loses its device blocks: copied to host swap space, or recomputed later."""
        self._preempt(data.draw(st.sampled_from(self._preemptable()), label="victim"), data)

    @precondition(lambda self: self.may_grow and self._growable())
    @rule(data=st.data())
    def schedule_running(self, data):
        """Scheduler.schedule's running loop: decodes first, then prefill chunks; when a sequence cannot get its
        slots, a running sequence is preempted (by swap or recompute; maybe one already placed, maybe itself)."""
        ready = self._growable()
        for seq in sorted(ready, key=lambda s: s.num_tokens - s.num_computed_tokens != 1):
            if seq.status != "running":
                continue  # preempted earlier in this loop
            self.considered.add(seq.name)
            n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens), label=f"n for Seq{seq.name}")
            while not self._allocate(seq, n):
                victim = data.draw(st.sampled_from(self._preemptable()), label="victim")
                self._preempt(victim, data)
                if victim is seq:
                    break
            if seq.status == "running":
                self.plan.append([seq, n])

    def _releasable(self) -> list[Seq]:
        return self._with("running", lambda s: s.num_computed_tokens > 0 and s.name not in self.considered)

    @precondition(lambda self: self.may_grow and self._releasable())
    @rule(data=st.data())
    def release(self, data):
        """Scheduler.schedule on a model with one sliding window on every layer, before a running sequence's
        slots: its blocks wholly behind the window go back (their entries become the null block)."""
        seq = data.draw(st.sampled_from(self._releasable()), label="seq")
        first_needed = data.draw(st.integers(0, seq.num_computed_tokens), label="first slot still needed")
        table, refs = list(seq.block_table), {b: self.pool.blocks[b].ref_count for b in seq.block_table}
        free, gone = self.kv.num_free_blocks, self.kv.release_behind(seq, first_needed)
        limit = seq.num_published_blocks - 1 if self.kv.enable_prefix_caching else first_needed // self.bs
        count = max(min(first_needed // self.bs, limit), released_prefix(table))
        assert seq.block_table == [NULL_BLOCK] * count + table[count:], (table, seq.block_table, count)
        dropped = [b for b in table[:count] if b != NULL_BLOCK]
        assert gone == len(dropped)
        for b in set(dropped):
            assert self.pool.blocks[b].ref_count == refs[b] - dropped.count(b)
        assert self.kv.num_free_blocks == free + sum(1 for b in set(dropped) if self.pool.blocks[b].ref_count == 0)
        if gone:
            event("released blocks behind a window")

    # ---- schedule: admission (only when nothing was preempted in this schedule) -------------------------------
    def _admit(self, seq: Seq, n_strategy, data) -> None:
        hits = self.kv.computed_blocks(seq)
        self._hits_are_right(seq, hits)
        revived = sum(1 for b in hits if b.ref_count == 0)
        fits = blocks_needed(seq.num_tokens, self.bs) - len(hits) <= self.kv.num_free_blocks - revived
        assert self.kv.can_admit(seq, hits) == fits
        self.admitting = True
        if not fits:
            return
        event(f"admitted with {min(len(hits), 2)}+ prefix hits")
        covered = self.kv.admit(seq, hits)
        assert covered == len(hits) * self.bs and seq.block_table == [b.block_id for b in hits]
        seq.num_computed_tokens = covered
        n = data.draw(st.integers(1, seq.num_tokens - covered), label="n")
        assert self._allocate(seq, n), "can_admit said the whole request fits"
        self.kv.count_lookup(seq, covered)
        seq.status = "running"
        self.plan.append([seq, n])

    @precondition(lambda self: self.may_admit and len(self.seqs) < MAX_SEQS)
    @rule(data=st.data(), prompt=st.lists(st.integers(1, 2), min_size=1, max_size=9), salt=st.sampled_from(SALTS))
    def admit_new(self, data, prompt, salt):
        self.names += 1
        seq = Seq(self.names, list(prompt), len(prompt), salt)
        self.seqs.append(seq)
        self._admit(seq, None, data)

    @precondition(lambda self: self.may_admit and self._with("waiting"))
    @rule(data=st.data())
    def readmit(self, data):
        self._admit(data.draw(st.sampled_from(self._with("waiting")), label="waiting"), None, data)

    @precondition(lambda self: self.may_admit and self._with("swapped"))
    @rule(data=st.data())
    def swap_back_in(self, data):
        seq = data.draw(st.sampled_from(self._with("swapped")), label="swapped")
        self.admitting = True
        released = sum(1 for h in seq.host if h == RELEASED)
        if blocks_needed(seq.num_tokens, self.bs) - released > self.kv.num_free_blocks:  # Scheduler._swap_in's check
            return
        event("swap in")
        host = [h for h in seq.host if h != RELEASED]  # Scheduler._swap_in: the released run stays the null block
        device = self.kv.allocate_blocks(len(host))
        assert len(set(device)) == len(device) and NULL_BLOCK not in device
        assert all(self.pool.blocks[b].ref_count == 1 for b in device)
        seq.block_table = [NULL_BLOCK] * (len(seq.host) - len(host)) + device
        self.swap_in.append((host, device, seq))
        seq.host, seq.status = [], "running"
        n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens), label="n")
        assert self._allocate(seq, n), "Scheduler._swap_in checked room for the whole request"
        self.plan.append([seq, n])

    # ---- the step: block moves in the engine's order, then the forward pass writes -----------------------------
    @precondition(lambda self: not self.updating and not self.idle)
    @rule()
    def step(self):
        for device_ids, host_ids in self.swap_out:
            for d, h in zip(device_ids, host_ids):
                self.host_content[h] = list(self.content[d])
        cleared = self.kv.take_blocks_to_clear()
        assert NULL_BLOCK not in cleared
        for b in cleared:
            self.content[b] = [ZERO] * self.bs
        copies = self.kv.take_copies()
        for src, dst in copies:
            assert NULL_BLOCK not in (src, dst) and src != dst
            self.content[dst] = list(self.content[src])
        swap_in, self.swap_in = self.swap_in, []
        for host_ids, device_ids, _ in swap_in:
            for h, d in zip(host_ids, device_ids):
                self.content[d] = list(self.host_content[h])
            self.swap.free(host_ids)
        # nothing a sequence holds may be uninitialised or NaN when the forward pass reads it (masked slots too)
        for seq in self._with("running"):
            for b in seq.block_table:
                assert GARBAGE not in self.content[b] and NAN not in self.content[b], \
                    f"{seq} holds block {b} = {self.content[b]} in a forward pass"
        self.written = {}
        for seq, n in self.plan:
            start = seq.num_computed_tokens
            assert len(seq.block_table) * self.bs >= start + n
            for p in range(start, start + n):
                b = seq.block_table[p // self.bs]
                block = self.pool.blocks[b]
                assert b != NULL_BLOCK
                assert block.ref_count == 1, f"{seq} writes token {p} into block {b} shared by {block.ref_count}"
                assert block.block_hash is None, f"{seq} writes into block {b}, which is in the prefix map"
                self.content[b][p % self.bs] = seq.kv_of(p)
                self.written.setdefault(seq.name, set()).add(b)
            seq.num_computed_tokens += n
            self._publish(seq)
        self.completed = [seq for seq, _ in self.plan if seq.num_computed_tokens == seq.num_tokens]
        self.updating = bool(self.completed)
        self._new_plan()
        self._check_common_prefixes()

    def _publish(self, seq: Seq) -> None:
        before = {b: self.pool.blocks[b].block_hash for b in seq.block_table}
        published = seq.num_published_blocks
        self.kv.cache_full_blocks(seq)
        assert seq.num_published_blocks == max(published, seq.num_computed_tokens // self.bs)
        for i in range(published, seq.num_published_blocks):
            b = seq.block_table[i]
            record = (seq.salt, tuple(seq.all_token_ids[:(i + 1) * self.bs]))
            if before[b] is None and self.pool.blocks[b].block_hash is not None:
                self.published[b] = record
                parent = self.pool.blocks[b].parent  # a lookup reaches a block only through its cached parent
                assert parent is None or parent.block_hash is not None, f"block {b} published under an unfindable parent"
            elif self.pool.blocks[b].block_hash is not None:
                assert self.published[b] == record, f"block {b} is cached for other tokens than {seq} holds there"

    # ---- update: right after the step, then between steps ---------------------------------------------------------
    def _fork(self, parent: Seq) -> Seq:
        """Another sample starts from `parent`'s just-computed tokens (Scheduler._start_fork)."""
        self.names += 1
        child = Seq(self.names, list(parent.all_token_ids), parent.prompt_len, parent.salt)
        held = [b for b in parent.block_table if b != NULL_BLOCK]
        refs = [self.pool.blocks[b].ref_count for b in held]
        self.kv.fork(parent, child)
        assert child.block_table == parent.block_table and child.block_table is not parent.block_table
        assert [self.pool.blocks[b].ref_count for b in held] == [r + 1 for r in refs]
        assert child.num_published_blocks == parent.num_published_blocks
        child.num_computed_tokens, child.status = parent.num_computed_tokens, "running"
        self.seqs.append(child)
        return child

    def _release(self, seq: Seq) -> None:
        self.kv.free(seq)
        assert seq.block_table == [] and seq.num_published_blocks == 0
        if seq.host:
            self.swap.free([h for h in seq.host if h != RELEASED])
            seq.host = []
        self.seqs.remove(seq)

    @precondition(lambda self: self.updating)
    @rule(data=st.data())
    def update(self, data):
        """Scheduler.update: each sequence the step completed samples from its logits row. More samples may fork
        from it first (n > 1: they share that row); then a non-finite row ends all of them and discards their K/V,
        or each gets its next token or finishes."""
        self.updating = False
        for parent in self.completed:
            row = [parent]
            room = MAX_SEQS - len(self.seqs)
            if room and data.draw(st.booleans(), label=f"fork Seq{parent.name}"):
                event("fork")
                row += [self._fork(parent) for _ in range(data.draw(st.integers(1, room), label="children"))]
            if data.draw(st.integers(0, 11), label="row outcome") == 0:
                event("non-finite")
                for b in self.written.get(parent.name, ()):
                    self.content[b] = [NAN] * self.bs  # what the pass wrote may be NaN (only this row holds it)
                for seq in row:
                    self.kv.discard_contents(seq)
                    assert all(self.pool.blocks[b].block_hash is None for b in seq.block_table)
                    self._release(seq)
                continue
            for seq in row:
                token = data.draw(st.integers(0, 11), label=f"token for Seq{seq.name}")
                if token == 0:
                    self._release(seq)  # it stopped
                else:
                    seq.all_token_ids.append(1 + token % 2)
        self.completed = []

    @precondition(lambda self: self.idle and self.seqs)
    @rule(data=st.data())
    def abort(self, data):
        """A sequence is aborted between steps, wherever it is (running, waiting or swapped)."""
        self._release(data.draw(st.sampled_from(self.seqs), label="seq"))

    def teardown(self):
        if not hasattr(self, "kv"):  # hypothesis can stop before the initialize rule ran
            return
        for host_ids, _, _ in self.swap_in:
            self.swap.free(host_ids)
        for seq in list(self.seqs):
            self._release(seq)
        self.kv.take_blocks_to_clear()
        self.kv.take_copies()
        self.pool.check_all_free()
        assert self.swap.num_free == self.swap.num_blocks
        assert not self.pool.cached or all(b.ref_count == 0 for b in self.pool.cached.values())


SETTINGS = settings(max_examples=220, stateful_step_count=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
KVMachine.TestCase.settings = SETTINGS
TestKV = KVMachine.TestCase
