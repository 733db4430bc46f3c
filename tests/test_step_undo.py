"""engine/step_undo.py: a failed step is put back exactly (queues, counters, every request it touched, the block
pool); an interrupted undo still runs every part and leaves the scheduler marked broken."""
import pytest

from hf_paged.config import EngineConfig
from hf_paged.engine.plan import Sampled, StepOutcome
from hf_paged.engine.scheduler import Scheduler
from hf_paged.kv import KVCacheManager
from hf_paged.request import Request, ParentRequest, RequestStatus
from hf_paged.sampling import SamplingParams


def make(name, prompt):
    group = ParentRequest(name, 0, None, list(prompt))
    request = Request(group, list(prompt), SamplingParams(max_tokens=4, ignore_eos=True))
    group.samples.append(request)
    return request


def scheduler():
    config = EngineConfig(block_size=4, num_blocks=16, preemption_mode="recompute")
    return Scheduler(config, KVCacheManager(16, 4, config.enable_prefix_caching))


def state(sched):
    pool = sched.kv.pool
    return ([r.parent.request_id for r in sched.waiting], [r.parent.request_id for r in sched.running],
            dict(sched.counters), pool.num_free_blocks, [b.ref_count for b in pool.blocks],
            [(r.status, r.num_computed_tokens, list(r.output_token_ids), [list(t) for t in r.block_tables])
             for r in sched.running + list(sched.waiting)])


def one_step(sched):
    plan = sched.schedule()
    sched.update(plan, StepOutcome([Sampled(token=7) for _ in plan.sampled]))


def test_rollback_puts_the_scheduler_back_as_it_was_at_begin():
    sched = scheduler()
    sched.add(make("a", range(1, 7)))
    one_step(sched)  # a runs, holding blocks and one output
    sched.add(make("b", range(11, 20)))
    before = state(sched)
    sched.undo.begin()
    one_step(sched)  # a decodes, b is admitted
    assert state(sched) != before
    sched.undo.rollback()
    assert state(sched) == before and sched.undo.broken is None
    sched.undo.begin()
    one_step(sched)
    sched.undo.commit()
    sched.undo.rollback()  # nothing to undo after a commit
    assert state(sched) != before and len(sched.running) == 2


def test_an_interrupted_undo_runs_every_part_and_marks_the_scheduler_broken(monkeypatch):
    sched = scheduler()
    a = make("a", range(1, 7))
    sched.add(a)
    sched.undo.begin()
    one_step(sched)
    monkeypatch.setattr(Request, "restore", lambda self, saved: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        sched.undo.rollback()
    assert "interrupted (KeyboardInterrupt)" in sched.undo.broken
    assert [r.parent.request_id for r in sched.waiting] == ["a"] and sched.running == []  # the queues were put back
    assert sched.kv.pool._journal is None  # and so was the pool, after the failing part
    assert a.status is RequestStatus.RUNNING  # the one part that failed
