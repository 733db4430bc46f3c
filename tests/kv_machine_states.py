"""State layers in the kv state machine (tests/test_kv_state_machine.py).

With state layers drawn, the manager gets `StateSlots` and `StateCheckpoints` made as the engine makes them
(`Engine.__init__`, `engine._state_checkpoints`), and the machine's forward runs the runner's state side for real:
the `sequences` of `ModelRunner.prepare`, `StateStep.build`, the `state_forward` adapter with its `StateView`s and
write-back, on a stand-in state module. Its state after some rows is the sequence's (salt, every token up to the last
row), stored as a code in the real slot and checkpoint tensors; a run that continues a state must read the state after
exactly the tokens before its rows. So what every slot and checkpoint HOLDS is read back from the tensors: GARBAGE
(never written), ZERO (a grown tensor's new rows), NAN (a non-finite pass) or the state after a sequence's tokens."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from hypothesis import event, strategies as st
from hypothesis.stateful import invariant

from hf_paged.config import EngineConfig
from hf_paged.engine.engine import _state_checkpoints
from hf_paged.kv.state import StateSlots
from hf_paged.model.state_layers import AS_IS, KEEP_STATES, TOKEN_BY_TOKEN, StateStep, state_forward
from kv_machine_model import GARBAGE, NAN, ZERO, Seq, chain_keys

KEY = (0, "recurrent", 0)  # the one state tensor of the stand-in model's one state layer
CPU = torch.device("cpu")


class StepFailed(Exception):
    """The failure the machine injects into a step (the step is then rolled back)."""


class StateCodes:
    """State values <-> the float64 codes the real tensors store (exact small integers; NaN is NAN)."""

    def __init__(self):
        self.values: list = [ZERO, GARBAGE]  # 0: the zeros of a tensor's new rows
        self.codes = {value: code for code, value in enumerate(self.values)}

    def encode(self, value) -> float:
        if value == NAN:
            return math.nan
        if value not in self.codes:
            self.codes[value] = len(self.values)
            self.values.append(value)
        return float(self.codes[value])

    def decode(self, code: float):
        return NAN if math.isnan(code) else self.values[int(code)]


class StateModule:
    """A stand-in state module, called as transformers calls one (hidden states, the cache)."""

    def __init__(self, machine):
        self.machine, self.calls, self.fail_at = machine, 0, None

    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        return self.machine._state_module_call(self, hidden_states, cache_params)


class MasklessStateModule(StateModule):
    """One that takes no attention mask: a left-padded batch of starting sequences runs one sequence at a time."""

    def forward(self, hidden_states, cache_params=None):
        return self.machine._state_module_call(self, hidden_states, cache_params)


class KVStates:
    """Mixed into the machine: reads its `kv`, `plan`, `seqs`, `bs` and `in_step`."""

    state_layers = True  # False: never draw a model with state layers

    def _setup_states(self, data, prefix_caching: bool, max_seqs: int):
        """(states, checkpoints) for the manager: None, None without state layers (and always with colliding keys:
        a checkpoint is found by its key alone, so a key that forgets the prefix would restore a wrong state)."""
        self.codes, self.prefix_of, self.cut_slots, self.rows, self.forward_slots = StateCodes(), {}, {}, [], []
        if not (self.exact_hash and self.state_layers and data.draw(st.booleans(), label="state layers")):
            return None, None
        config = EngineConfig(max_num_seqs=data.draw(st.integers(1, max_seqs), label="max_num_seqs"),
                              enable_prefix_caching=prefix_caching,
                              state_checkpoints=data.draw(st.one_of(st.none(), st.integers(0, 2 * max_seqs)),
                                                          label="state_checkpoints"),
                              state_checkpoint_interval=data.draw(st.integers(1, 3), label="checkpoint interval"))
        states = StateSlots(CPU, config.max_num_seqs)  # as Engine.__init__
        checkpoints = _state_checkpoints(config, CPU)
        continuation = data.draw(st.sampled_from([AS_IS, KEEP_STATES, TOKEN_BY_TOKEN]), label="continuation")
        masked = data.draw(st.booleans(), label="state module takes a mask")
        self.state_module = (StateModule if masked else MasklessStateModule)(self)
        self._context = SimpleNamespace(states=None)
        owner = SimpleNamespace(require_context=lambda module: self._context)
        self.state_forward = state_forward(0, "cache_params", continuation)(self.state_module, owner)
        if data.draw(st.booleans(), label="state tensors start as garbage"):  # else made at the first write
            for store in (states, None if checkpoints is None else checkpoints.store):
                if store is not None:
                    self._write_state(store, list(range(store.capacity)), GARBAGE)
        event("state layers" + ("" if checkpoints is not None and prefix_caching else ", no checkpoints"))
        return states, checkpoints

    # ---- what the tensors hold ---------------------------------------------------------------------------------
    def _slot_state(self, slot: int, store: StateSlots | None = None):
        value = (store or self.kv.states).read(KEY, torch.tensor([slot]))
        return GARBAGE if value is None else self.codes.decode(value[0, 0].item())

    def _saved_state(self, saved: dict | None):
        value = None if saved is None else saved.get(KEY)
        return GARBAGE if value is None else self.codes.decode(value[0].item())

    def _write_state(self, store: StateSlots, slots: list[int], value) -> None:
        """Device memory written outside the forward's model (as torch.empty leaves it, or a non-finite pass)."""
        if slots:
            with torch.inference_mode():  # as the forward writes (the tensors are inference tensors)
                store.write(KEY, torch.tensor(slots), torch.full((len(slots), 1), self.codes.encode(value),
                                                              dtype=torch.float64))

    # ---- the scheduler's side ----------------------------------------------------------------------------------
    def _state_after_admit(self, seq: Seq, covered: int) -> None:
        """`KVCacheManager.admit`: a slot, and at a prefix hit the state after exactly the hit's tokens, from the
        checkpoint of the hit's last block (a hit on a state model ends only there)."""
        if self.kv.states is None:
            assert seq.state_slot == -1
            return
        assert seq.state_slot >= 0 and all(s.state_slot != seq.state_slot for s in self.seqs if s is not seq)
        if covered:
            checkpoints = self.kv.checkpoints
            assert (covered // self.bs) % checkpoints.interval == 0, f"{seq}: a hit of {covered} tokens ends " \
                f"at a block that is not checkpointed (every {checkpoints.interval} blocks)"
            assert seq.block_hashes[covered // self.bs - 1] in checkpoints.keys
            held = self._slot_state(seq.state_slot)
            assert held == seq.state_after(covered), \
                f"{seq}: its prefix hit of {covered} tokens restored the state {held!r}"
            event("a prefix hit restores a checkpointed state")

    def _save_state(self, seq: Seq) -> None:
        """Scheduler._preempt by swap: the state goes to host memory right away, before any forward."""
        if seq.state_slot >= 0:
            seq.swapped_state = self.kv.states.save(seq.state_slot)
            event("a state swapped out")

    def _load_state(self, seq: Seq) -> None:
        """Scheduler._swap_in: a slot again, and the saved state in it."""
        if seq.swapped_state is not None:
            self.kv.take_state_slot(seq)
            self.kv.states.load(seq.state_slot, seq.swapped_state)
            seq.swapped_state = None
            event("a state swapped in")

    def _reserve_checkpoints(self) -> list[list[tuple[int, int]]]:
        """The end of Scheduler.schedule: each planned sequence's checkpoints (rows into it, checkpoint slot), checked
        against the prompt block boundaries its chunk crosses. What each slot must hold is noted under its key."""
        checkpoints = self.kv.checkpoints
        if checkpoints is None:
            return [[] for _ in self.plan]
        found, taken = [], set()
        for seq, n in self.plan:
            start, bs = seq.num_computed_tokens, self.bs
            kept = set(checkpoints.keys)
            cuts = self.kv.reserve_checkpoints(seq, n)
            crossed = [block for block in range(start // bs + 1, min(start + n, seq.prompt_len) // bs + 1)
                       if block % checkpoints.interval == 0]
            blocks = [(start + offset) // bs for offset, _ in cuts]
            assert all((start + offset) % bs == 0 for offset, _ in cuts) and blocks == sorted(set(blocks)) \
                and set(blocks) <= set(crossed), f"{seq}: checkpoints {cuts} for a chunk of {n} tokens"
            keys = chain_keys(seq.all_token_ids, seq.salt, bs, crossed[-1] if crossed else 0)
            for block in crossed:  # kept already, reserved now, or every slot is being written in this step
                assert keys[block - 1] in kept or block in blocks or \
                    len(checkpoints._assigned) == checkpoints.store.capacity, f"{seq}: no checkpoint at block {block}"
            for offset, slot in cuts:
                assert 0 < offset <= n and slot not in taken, f"{seq}: checkpoints {cuts}"
                taken.add(slot)
                block = (start + offset) // bs
                assert checkpoints.keys.get(keys[block - 1]) == slot
                expected = self.prefix_of.setdefault(keys[block - 1], seq.state_after(block * bs))
                assert expected == seq.state_after(block * bs), "two prefixes under one checkpoint key"
            if cuts:
                event("a step writes checkpoints")
            found.append(cuts)
        return found

    # ---- the forward ------------------------------------------------------------------------------------------
    def _state_forward(self, cuts: list[list[tuple[int, int]]], fail_at: int | None) -> None:
        """The state layer of the step's forward, packed as ModelRunner.prepare packs it (every planned sequence's
        rows in plan order; it starts from no state when it starts at token 0). With `fail_at`, the module's call of
        that number (or the end of the forward) raises StepFailed: the calls before it have written back."""
        if self.kv.states is None or not self.plan:
            if fail_at is not None:
                raise StepFailed("the forward failed")
            return
        sequences, self.rows, self.cut_slots = [], [], {}
        self.forward_slots = [seq.state_slot for seq, _ in self.plan]
        for (seq, n), seq_cuts in zip(self.plan, cuts):
            start = seq.num_computed_tokens
            sequences.append((len(self.rows), n, seq.state_slot, start == 0, True, seq_cuts))
            self.rows += [(seq, p) for p in range(start, start + n)]
            self.cut_slots[seq.name] = [slot for _, slot in seq_cuts]
        store = None if self.kv.checkpoints is None else self.kv.checkpoints.store
        self._context.states = StateStep.build(self.kv.states, sequences, CPU, store)
        self.state_module.calls, self.state_module.fail_at = 0, fail_at
        hidden = torch.arange(1, len(self.rows) + 1, dtype=torch.float64).reshape(1, -1, 1)
        with torch.inference_mode():  # ModelRunner.execute
            out = self.state_forward(hidden)
        assert torch.equal(out, hidden), "the state runs' outputs were not put back in packed row order"
        if fail_at is not None:
            raise StepFailed("the forward failed after its state layer")

    def _state_module_call(self, module: StateModule, hidden_states: torch.Tensor, cache) -> torch.Tensor:
        """One call of the stand-in module: each line of `hidden_states` is one sequence's rows (their packed row
        numbers + 1; 0: left padding). It reads the line's state through `cache` (None: it starts from nothing),
        which must be the state after exactly the tokens before the line's first row, and stores the state after
        its last row."""
        if module.fail_at == module.calls:
            raise StepFailed(f"the forward failed in call {module.calls} of the state module")
        module.calls += 1
        before = cache.get_recurrent_state(0)
        after = []
        for b, line in enumerate(hidden_states[..., 0].round().long().tolist()):
            rows = [self.rows[r - 1] for r in line if r > 0]
            seq, first = rows[0]
            assert all(s is seq and p == first + i for i, (s, p) in enumerate(rows)), \
                f"a call of the state module takes rows {rows} (not one sequence's tokens in order)"
            read = None if before is None else self.codes.decode(before[b, 0].item())
            expected = None if first == 0 else seq.state_after(first)
            assert read == expected, f"{seq}: its state run from token {first} reads {read!r} (slot " \
                                     f"{seq.state_slot}) instead of {'no state' if first == 0 else expected}"
            after.append(seq.state_after(first + len(rows)))
        values = torch.tensor([[self.codes.encode(v)] for v in after], dtype=torch.float64)
        cache.update_recurrent_state([values] if cache.get_recurrent_states_to_keep(0) else values, 0)
        return hidden_states

    def _non_finite_states(self, parent: Seq, row: list[Seq]) -> None:
        """The row's pass went non-finite: its state (and the samples' copies) may be NaN, and so may the
        checkpoints it cut in this pass (`discard_contents` must forget them)."""
        if self.kv.states is not None:
            self._write_state(self.kv.states, [seq.state_slot for seq in row], NAN)
            if self.kv.checkpoints is not None:
                self._write_state(self.kv.checkpoints.store, self.cut_slots.get(parent.name, []), NAN)

    def _failed_states_nan(self) -> None:
        """A failed forward's state writes (every planned sequence's slot, every checkpoint it cut) hold NaN."""
        if self.kv.states is not None:
            self._write_state(self.kv.states, self.forward_slots, NAN)
            if self.kv.checkpoints is not None:
                self._write_state(self.kv.checkpoints.store, [s for c in self.cut_slots.values() for s in c], NAN)

    # ---- invariants ---------------------------------------------------------------------------------------------
    @invariant()
    def state_slots(self):
        """Every running sequence holds exactly one slot of its own, and once it has computed tokens, its slot holds
        the state after exactly them (a swapped one, its saved state); nobody else holds a slot."""
        states = self.kv.states
        if states is None:
            assert all(seq.state_slot == -1 and seq.swapped_state is None for seq in self.seqs)
            return
        held: dict[int, Seq] = {}
        for seq in self.seqs:
            computed = seq.num_computed_tokens
            if seq.status != "running":
                assert seq.state_slot == -1, f"{seq} holds a state slot"
                assert (seq.swapped_state is not None) == (seq.status == "swapped")
                if seq.status == "swapped":
                    saved = self._saved_state(seq.swapped_state)
                    assert saved == seq.state_after(computed), f"{seq}: its swapped state is {saved!r}"
                continue
            assert seq.state_slot >= 0, f"{seq} runs without a state slot"
            assert seq.state_slot not in held, f"{seq} and {held[seq.state_slot]} share state slot {seq.state_slot}"
            held[seq.state_slot] = seq
            if computed:
                state = self._slot_state(seq.state_slot)
                assert state == seq.state_after(computed), f"{seq}: its state slot holds {state!r}"
        free = states._free
        assert len(set(free)) == len(free) and not set(free) & set(held)
        assert set(free) | set(held) == set(range(states.capacity)), "a state slot is neither free nor held"

    @invariant()
    def state_checkpoints(self):
        """Every kept checkpoint holds the state after exactly the prefix its key names (written, not only reserved;
        not overwritten); its slots are the store's used ones."""
        checkpoints = self.kv.checkpoints if self.kv.states is not None else None
        if checkpoints is None:
            return
        slots, free = list(checkpoints.keys.values()), checkpoints.store._free
        assert len(set(slots)) == len(slots), f"two checkpoint keys share a slot: {checkpoints.keys}"
        assert not set(slots) & set(free) and len(set(free)) == len(free)
        assert set(slots) | set(free) == set(range(checkpoints.store.capacity))
        for key, slot in checkpoints.keys.items():
            held = self._slot_state(slot, checkpoints.store)
            assert held == self.prefix_of[key], \
                f"checkpoint slot {slot} holds {held!r}, its key names the state after {self.prefix_of[key]}"

    def _states_all_free(self) -> None:
        """Teardown: every sequence gone, every state slot free; the checkpoints go with `clear`."""
        if self.kv.states is not None:
            self.kv.states.check_all_free()
            self.kv.states.release()
            if self.kv.checkpoints is not None:
                self.kv.checkpoints.clear()
                self.kv.checkpoints.store.check_all_free()
