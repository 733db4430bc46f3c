"""Defects the kv state machine (tests/test_kv_state_machine.py) found, each as the shortest sequence of calls that
shows it (both fixed in fc83e6a; the machine checks them too, the second by default).

The machine's switch `KVStep.failed_writes_nan` (a failed step's forward wrote non-finite values, which the rollback
must distrust) finds the first. It is off by default because it still finds such values left in blocks that survive
the rollback and are read masked later: a surviving request whose retried chunk is shorter than the failed one (its
own tail block, kept with `distrust_tail`'s mark); the partly filled block that forks share, written in place by the
last of them, copied on write for a sample that is then preempted in the same schedule into a block handed out to
another request (a copy's destination is not cleared).
"""
from __future__ import annotations

from hf_paged.config import EngineConfig
from hf_paged.engine.scheduler import Scheduler
from hf_paged.kv import KVCacheManager
from hf_paged.kv.state import StateCheckpoints, StateSlots
from hf_paged.request import RequestStatus
from kv_machine_model import Seq
from test_scheduler import make, step


def test_a_block_a_failed_forward_wrote_is_cleared_before_another_request_gets_it():
    """A model with state layers: after a failed step every running request is recomputed, and its blocks go back
    to the pool. The block holding its next slot was written by the failed forward past its computed tokens
    (`distrust_tail`'s case: possibly non-finite); it must be cleared before its next holder reads those slots masked
    (NaN x 0 is NaN). It was not (StepUndo._distrust called distrust_tail only for requests it did not recompute)."""
    config = EngineConfig(block_size=4, num_blocks=4, preemption_mode="recompute")
    sched = Scheduler(config, KVCacheManager(4, 4, True, states=StateSlots("cpu", 2)))
    first = make([1, 2], max_tokens=8, name="first")
    sched.add(first)
    step(sched)  # the prompt's 2 tokens in slots 0-1 of one block; token 5 sampled
    block = first.block_tables[0][0]
    sched.undo.begin()
    plan = sched.schedule()  # the decode of token 5 writes slot 2 of `block` in the forward ...
    assert plan.requests == [first]
    sched.undo.rollback()  # ... which then fails
    assert first.status is RequestStatus.PREEMPTED and first.block_tables == []  # recomputed: `block` is free
    sched.abort(first)
    second = make([7], name="second")
    sched.add(second)
    plan = sched.schedule()
    assert second.block_tables == [[block]]  # reads slots 1-3 of `block` masked: slot 2 holds the failed write
    assert block in plan.blocks_to_clear


def test_a_checkpoint_cut_by_a_non_finite_pass_serves_no_prefix_hit():
    """Two sequences compute the same prompt; the checkpoint of the first was evicted in between, so the second
    writes it again, and its pass goes non-finite: its own blocks leave the prefix map (`discard_contents`). The
    checkpoint stayed, and a third prompt like them hit the first one's blocks and restored it."""
    kv = KVCacheManager(16, 2, True, states=StateSlots("cpu", 4), checkpoints=StateCheckpoints("cpu", 1, 1))

    def prefill(seq: Seq) -> list[tuple[int, int]]:
        """Admit `seq` (from its prefix hits) and compute all its tokens in one step: its checkpoint cuts."""
        seq.num_computed_tokens = kv.admit(seq, kv.computed_blocks(seq))
        num_new = seq.num_tokens - seq.num_computed_tokens
        assert kv.allocate_slots(seq, num_new)
        kv.begin()
        cuts = kv.reserve_checkpoints(seq, num_new)
        kv.commit()
        seq.num_computed_tokens += num_new
        kv.cache_full_blocks(seq)
        return cuts

    first, other, again = Seq(1, [1, 1, 1], 3, None), Seq(2, [2, 2, 2], 3, None), Seq(3, [1, 1, 1], 3, None)
    assert len(prefill(first)) == 1  # the state after [1, 1]
    kv.free(first)  # finished: its blocks stay in the prefix map
    assert len(prefill(other)) == 1  # the one checkpoint slot now holds the state after [2, 2]
    assert kv.computed_blocks(again) == []  # the first one's block is there, its state is not
    assert len(prefill(again)) == 1  # the state after [1, 1] again: this pass goes non-finite
    kv.discard_contents(again)
    kv.free(again)
    assert kv.computed_blocks(Seq(4, [1, 1, 1], 3, None)) == [], \
        "a prefix hit restores the state a non-finite pass cut"
