"""A stateful (hypothesis) model of hf_paged.kv, driven the way the scheduler drives it.

The machine keeps a small pool (4-10 blocks of 2-4 tokens per KV group) and a few sequences, and steps like the
engine does: a *schedule* phase (running sequences give back the blocks behind their windows and grow with
`allocate_slots`, at most `max_chunk` tokens a step; running sequences are preempted by recompute or by swap; then,
only if nothing was preempted, waiting sequences are admitted from their prefix hits and swapped sequences come back
with `allocate_blocks`), then a *step* that applies the block moves in the engine's order (swap out, copy-on-write
copies, clear, swap in), writes the scheduled tokens and updates (sample a token, fork, finish, a non-finite error
that discards the contents); aborts come between steps. A step may fail (in its schedule, block moves, forward or
update) and is then undone as StepUndo undoes it (kv_machine_step.py).

The manager coordinates a drawn layout of KV groups (one full-attention group, or mixes with sliding groups of
small windows): every sequence has one table per group, all drawing from one pool; a sliding group gives back the
blocks behind its window (`release_behind`) and a prefix hit serves it only the blocks its window sees.

Besides the bookkeeping (reference counts, free queue, prefix map, swap pool), the machine models what every
block *holds*: each slot is GARBAGE (never written, as torch.empty), ZERO (cleared), NAN (written by a forward pass
that went non-finite) or the K/V of one token in one group, named by (group, cache salt, all tokens up to and
including it). So it checks end to end that a sequence's computed tokens are really in each group's table (every
slot its window sees, and every block it still holds), whatever prefix hits, releases, copy-on-write, swaps and
block reuse happened, and that no block a sequence holds ever holds garbage or NaN.

A model with state layers may be drawn (kv_machine_states.py): the manager then gets the engine's state slots and
checkpoints, the machine's forward runs the runner's state step on a stand-in state module, and the machine checks
what every slot and checkpoint holds: a running sequence's slot (its own, exactly one) the state after exactly its
computed tokens, through chunks, prefix hits, forks, swaps, recomputes, aborts and failed steps; a kept checkpoint
the state after exactly its key's prefix; every slot free when idle.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import torch

from hf_paged.engine.scheduler import RELEASED
from hf_paged.kv import NULL_BLOCK, KVCache, KVCacheManager, KVCacheSpec, blocks_needed
from hf_paged.kv.swap import SwapPool
from kv_machine_groups import kv_groups, layouts, saved_blocks, swap_in_room, swapped_in_tables, swapped_layout
from kv_machine_calls import KVCalls
from kv_machine_model import GARBAGE, MAX_SEQS, ZERO, KVInvariants, Seq
from kv_machine_states import KVStates, StepFailed
from kv_machine_step import KVStep

SALTS = (None, "a", "b")


class KVMachine(KVCalls, KVInvariants, KVStates, KVStep, RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.seqs: list[Seq] = []
        self.names = 0
        self.in_step = False  # between StepUndo.begin (the schedule's first change) and the step's commit or rollback
        self.prompts: list[tuple[list[int], str | None]] = []  # every sequence's tokens when admitted (admit_again)
        self._new_plan()

    def _new_plan(self) -> None:
        self.plan: list[list] = []  # [seq, num_new_tokens]
        self.swap_out: list[tuple[list[int], list[int]]] = []  # (device ids, host ids)
        self.swap_in: list[tuple[list[int], list[int], Seq]] = []  # (host ids, device ids, seq)
        self.preempted = False
        self.admitting = False  # the scheduler admits after its running loop: no preemption nor growth after that
        self.considered: set[int] = set()  # running sequences the running loop has looked at (placed or not)

    exact_hash = True  # False in the variant whose block keys collide on purpose (see test_colliding_keys)

    @initialize(data=st.data(), per_group=st.integers(4, 10), block_size=st.integers(2, 4),
                swap_blocks=st.integers(1, 6), prefix_caching=st.sampled_from([True, True, True, False]))
    def setup(self, data, per_group, block_size, swap_blocks, prefix_caching):
        self.bs = block_size
        self.windows = data.draw(layouts(block_size, self.exact_hash), label="windows")
        num_blocks = per_group * len(self.windows)
        states, checkpoints = self._setup_states(data, prefix_caching, MAX_SEQS)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, states=states,
                                 checkpoints=checkpoints, groups=kv_groups(self.windows))
        assert self.kv.windows == list(self.windows) and self.kv.num_groups == len(self.windows)
        # the engine bounds the tokens one step computes for a sequence (its token budget): a releasing group then
        # holds a bounded number of blocks at once, and admission asks only for those (`group_bound`)
        self.max_chunk = data.draw(st.one_of(st.none(), st.integers(1, 3 * block_size)), label="max_chunk")
        self.kv.max_chunk = self.max_chunk
        event(f"{len(self.windows)} groups, {sum(w is not None for w in self.windows)} sliding")
        self.pool = self.kv.pool
        spec = KVCacheSpec(1, 1, 2, torch.float32, torch.device("cpu"))
        swap_blocks *= len(self.windows)
        self.swap = SwapPool(KVCache(spec, num_blocks + 1, block_size), swap_blocks)
        self.content = {b: [GARBAGE] * block_size for b in range(1, num_blocks + 1)}
        self.content[NULL_BLOCK] = [ZERO] * block_size
        self.host_content: dict[int, list] = {h: [GARBAGE] * block_size for h in range(swap_blocks)}
        self.published: dict[int, tuple] = {}  # block id -> (group, salt, every token up to its end) it was cached for
        self.written: dict[int, set[int]] = {}  # seq name -> blocks its last forward pass wrote

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _with(self, status: str, pred=lambda s: True) -> list[Seq]:
        return [s for s in self.seqs if s.status == status and pred(s)]

    @property
    def may_grow(self) -> bool:
        """In the scheduler's running loop (it comes before admission)."""
        return not self.admitting

    @property
    def may_admit(self) -> bool:
        """Scheduler._admit runs after the running loop looked at every running sequence, and only when it
        preempted none."""
        return not (self.preempted or self._growable())

    def _chunk(self, seq: Seq, data, label: str = "n") -> int:
        """Tokens the next step computes for `seq` (Scheduler._chunk: never more than `max_chunk`)."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        return data.draw(st.integers(1, min(remaining, self.max_chunk or remaining)), label=label)

    def _planned(self, seq: Seq) -> bool:
        return any(entry[0] is seq for entry in self.plan)

    def _unplan(self, seq: Seq) -> None:
        self.plan = [entry for entry in self.plan if entry[0] is not seq]

    # ---- schedule: the running loop ---------------------------------------------------------------------------
    def _growable(self) -> list[Seq]:
        return self._with("running", lambda s: s.num_computed_tokens < s.num_tokens and s.name not in self.considered)

    @precondition(lambda self: self.may_grow and self._growable())
    @rule(data=st.data())
    def grow(self, data):
        """A running sequence gets slots for its next chunk (copy-on-write of a shared block included)."""
        self._begin_step()
        seq = data.draw(st.sampled_from(self._growable()), label="seq")
        self.considered.add(seq.name)
        self._release_behind(seq, seq.num_computed_tokens)  # Scheduler.schedule, before each running one's slots
        n = self._chunk(seq, data)
        if self._allocate(seq, n):
            self.plan.append([seq, n])

    def _preemptable(self) -> list[Seq]:
        return self._with("running", lambda s: s.num_computed_tokens < s.num_tokens)

    def _saved(self, seq: Seq) -> list[int]:
        return saved_blocks(seq.block_tables, seq.num_computed_tokens, self.bs)[0]

    def _swappable(self) -> list[Seq]:
        return [s for s in self._preemptable() if 0 < len(self._saved(s)) <= self.swap.num_free]

    def _preempt_recompute(self, seq: Seq) -> None:
        self._unplan(seq)
        self.kv.free(seq)
        assert seq.block_tables == [] and seq.num_published_blocks == 0
        seq.num_computed_tokens, seq.status = 0, "waiting"
        self.preempted = True

    def _preempt_swap(self, seq: Seq) -> None:
        """Exactly what Scheduler._preempt records: every group's computed blocks but those a window gave back (the
        null block), group after group, after giving back what is behind each window (as the sequence's own schedule
        would have); a block given a private copy in this step is saved from its source."""
        self._release_behind(seq, seq.num_computed_tokens)
        device, released = saved_blocks(seq.block_tables, seq.num_computed_tokens, self.bs)
        event("swap out" + (" behind released blocks" if any(released) else ""))
        if set(device) & {dst for _, dst in self.kv._copies}:
            event("swap out of a block whose copy-on-write is pending")
        host = self.swap.allocate(len(device))
        assert len(set(host)) == len(device)
        self.swap_out.append((self.kv.current_contents(device), host))
        self._save_state(seq)
        self._unplan(seq)
        self.kv.free(seq)
        seq.host, seq.status = swapped_layout(host, released, seq.num_computed_tokens, self.bs), "swapped"
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
        self._begin_step()
        self._preempt(data.draw(st.sampled_from(self._preemptable()), label="victim"), data)

    @precondition(lambda self: self.may_grow and self._growable())
    @rule(data=st.data())
    def schedule_running(self, data):
        """Scheduler.schedule's running loop: decodes first, then prefill chunks; when a sequence cannot get its
        slots, a running sequence is preempted (by swap or recompute; maybe one already placed, maybe itself)."""
        self._begin_step()
        ready = self._growable()
        for seq in sorted(ready, key=lambda s: s.num_tokens - s.num_computed_tokens != 1):
            if seq.status != "running":
                continue  # preempted earlier in this loop
            self.considered.add(seq.name)
            self._release_behind(seq, seq.num_computed_tokens)
            n = self._chunk(seq, data, f"n for Seq{seq.name}")
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
        """Scheduler.schedule gives back, before a running sequence's slots, the blocks behind each sliding group's
        window from its next query (at num_computed_tokens); here from any position up to there."""
        self._begin_step()
        seq = data.draw(st.sampled_from(self._releasable()), label="seq")
        self._release_behind(seq, data.draw(st.integers(0, seq.num_computed_tokens), label="position"))

    # ---- schedule: admission (only when nothing was preempted in this schedule) -------------------------------
    def _admit(self, seq: Seq, data) -> None:
        hits = self.kv.computed_blocks(seq)
        self._hits_are_right(seq, hits)
        taken = [b for row in hits for b in row if b is not None]
        assert len({b.block_id for b in taken}) == len(taken), "one block serves two hit entries"
        revived = sum(1 for b in taken if b.ref_count == 0)
        # every group's blocks for the whole request (a releasing group's bound: the invariant `bounded` checks it),
        # less the hit blocks it holds already
        bounds = [self.kv.group_bound(g, seq.num_tokens) for g in range(len(self.windows))]
        assert self.kv.blocks_for(seq.num_tokens) == sum(bounds)
        need = sum(max(bound - sum(row[g] is not None for row in hits), 0) for g, bound in enumerate(bounds))
        fits = need <= self.kv.num_free_blocks - revived
        if min(bounds) < blocks_needed(seq.num_tokens, self.bs):
            event("admission asks a releasing group for its bound only")
        assert self.kv.can_admit(seq, hits) == fits
        self.admitting = True
        if not fits:
            return
        event(f"admitted with {min(len(hits), 2)}+ prefix hits")
        most = min(len(hits) * self.bs + (self.max_chunk or seq.num_tokens), seq.num_tokens)
        assert (blocks_needed(most, self.bs) - len(hits)) * len(self.windows) <= need, \
            f"{seq}: can_admit asks room for {need} blocks, the largest first chunk may take more"
        refs, free = {b.block_id: b.ref_count for b in taken}, self.kv.num_free_blocks
        covered = self.kv.admit(seq, hits)
        assert covered == len(hits) * self.bs
        self._state_after_admit(seq, covered)
        assert seq.block_tables == [[NULL_BLOCK if row[g] is None else row[g].block_id for row in hits]
                                    for g in range(len(self.windows))]
        assert all(self.pool.blocks[b].ref_count == refs[b] + 1 for b in refs)
        seq.num_computed_tokens = covered
        n = self._chunk(seq, data)
        assert self._allocate(seq, n), "can_admit said the whole request fits"
        assert free - self.kv.num_free_blocks <= need + revived, "the first chunk took more than can_admit asked for"
        self.kv.count_lookup(seq, covered)
        seq.status = "running"
        self.considered.add(seq.name)  # admitted: not in this schedule's running loop, and more may be admitted
        self.plan.append([seq, n])

    @precondition(lambda self: self.may_admit and len(self.seqs) < MAX_SEQS)
    @rule(data=st.data(), prompt=st.lists(st.integers(1, 2), min_size=1, max_size=12), salt=st.sampled_from(SALTS))
    def admit_new(self, data, prompt, salt):
        self._begin_step()
        self.names += 1
        seq = Seq(self.names, list(prompt), len(prompt), salt)
        self.seqs.append(seq)
        self.prompts.append((list(seq.all_token_ids), salt))
        self._admit(seq, data)

    @precondition(lambda self: self.may_admit and len(self.seqs) < MAX_SEQS and self.prompts)
    @rule(data=st.data(), tail=st.lists(st.integers(1, 2), max_size=6))
    def admit_again(self, data, tail):
        """A new sequence starting with (some of) the tokens of one seen before, with its salt: prefix hits."""
        tokens, salt = data.draw(st.sampled_from(self.prompts), label="like")
        prompt = tokens[:data.draw(st.integers(0, len(tokens)), label="kept")] + tail
        self.admit_new(data, prompt or [1], salt)

    @precondition(lambda self: self.may_admit and self._with("waiting"))
    @rule(data=st.data())
    def readmit(self, data):
        self._begin_step()
        self._admit(data.draw(st.sampled_from(self._with("waiting")), label="waiting"), data)

    @precondition(lambda self: self.may_admit and self._with("swapped"))
    @rule(data=st.data())
    def swap_back_in(self, data):
        self._begin_step()
        seq = data.draw(st.sampled_from(self._with("swapped")), label="swapped")
        self.admitting = True
        n = self._chunk(seq, data)  # Scheduler._admit picks the chunk first, then asks _swap_in for room for it
        room, free = swap_in_room(self.kv, seq.host, seq.num_tokens, seq.num_computed_tokens, n), self.kv.num_free_blocks
        if room > free:
            return
        host = [h for h in seq.host if h != RELEASED]
        event("swap in")
        device = self.kv.allocate_blocks(len(host))
        assert len(set(device)) == len(device) and NULL_BLOCK not in device
        assert all(self.pool.blocks[b].ref_count == 1 for b in device)
        seq.block_tables = swapped_in_tables(seq.host, device, len(self.windows))  # released runs: the null block
        self._load_state(seq)
        self.swap_in.append((host, list(device), seq))
        seq.host, seq.status = [], "running"
        assert self._allocate(seq, n), "Scheduler._swap_in checked room for its first chunk"
        assert free - self.kv.num_free_blocks <= room, \
            f"{seq}: its swap-in and first chunk took {free - self.kv.num_free_blocks} blocks, room asked {room}"
        self.considered.add(seq.name)
        self.plan.append([seq, n])

    # ---- the step: block moves in the engine's order, then the forward pass writes -----------------------------
    @precondition(lambda self: self.in_step)
    @rule(data=st.data())
    def step(self, data):
        """The end of the schedule (checkpoints reserved), the step's block moves and forward pass, then right away
        Scheduler.update (`_update`): nothing happens between a pass and its update (one rule, so that swarm testing
        never switches the update off alone). The step may fail at any of these; it is then undone (`_fail`)."""
        where = {28: "schedule", 29: "block moves", 30: "forward", 31: "update"}.get(
            data.draw(st.integers(0, 31), label="failure"))  # one step in eight fails
        cuts = self._reserve_checkpoints()
        if where == "schedule":
            return self._fail(where)
        self._moves()
        if where == "block moves":
            return self._fail(where)
        self._write_kv()
        try:
            self._state_forward(cuts, data.draw(st.integers(0, 6), label="failing call") if where == "forward"
                                else None)
        except StepFailed:
            return self._fail(where)
        for seq, n in self.plan:
            seq.num_computed_tokens += n
            self._publish(seq)
        completed = [seq for seq, _ in self.plan if seq.num_computed_tokens == seq.num_tokens]
        self._new_plan()
        self._check_common_prefixes()
        if completed:
            for check in (self.bookkeeping, self.prefix_map, self.sequences, self.bounded, self.swap_pool,
                          self.state_slots, self.state_checkpoints):
                check()  # the invariants hold between the pass and its update too
            self._update(completed, data, failing=where == "update")
        if where == "update":
            return self._fail(where)
        self._commit()

    @precondition(lambda self: not self.in_step and self.seqs)
    @rule(data=st.data())
    def abort(self, data):
        """A sequence is aborted between steps, wherever it is (running, waiting or swapped)."""
        self._release(data.draw(st.sampled_from(self.seqs), label="seq"))

    def teardown(self):
        if not hasattr(self, "kv"):  # hypothesis can stop before the initialize rule ran
            return
        if self.in_step:
            self._commit()
        for host_ids, _, _ in self.swap_in:
            self.swap.free(host_ids)
        for seq in list(self.seqs):
            self._release(seq)
        self.kv.take_blocks_to_clear()
        self.kv.take_copies()
        self.pool.check_all_free()
        self._states_all_free()
        assert self.swap.num_free == self.swap.num_blocks
        assert not self.pool.cached or all(b.ref_count == 0 for b in self.pool.cached.values())


# KV_MACHINE_EXAMPLES raises the run locally (e.g. KV_MACHINE_EXAMPLES=5000 with --hypothesis-seed)
SETTINGS = settings(max_examples=int(os.environ.get("KV_MACHINE_EXAMPLES", 400)), stateful_step_count=100,
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
KVMachine.TestCase.settings = SETTINGS
TestKV = KVMachine.TestCase
