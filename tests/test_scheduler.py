"""The scheduler as a unit (no model: each step's outcome is made up) and its fixes seen through the engine."""
import pytest

from hf_paged import LLM, SamplingParams
from hf_paged.config import EngineConfig
from hf_paged.engine.plan import Sampled, StepOutcome
from hf_paged.engine.scheduler import Scheduler
from hf_paged.kv import KVCacheManager
from hf_paged.request import Request, ParentRequest, RequestStatus

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make(prompt, max_tokens=4, priority=0, arrival=0, name="r"):
    group = ParentRequest(name, arrival, None, list(prompt))
    request = Request(group, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival=arrival,
                      priority=priority)
    group.samples.append(request)
    return request


def scheduler(num_blocks=32, block_size=4, **options):
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, preemption_mode="recompute", **options)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, config.enable_prefix_caching))


def step(sched, token=5):
    """One step with a made-up outcome: every sampled request gets `token`. Returns the plan."""
    plan = sched.schedule()
    sched.update(plan, StepOutcome([Sampled(token=token) for _ in plan.sampled]))
    return plan


def check_consistent(sched):
    """Every running request holds blocks for its computed tokens; free + held == total."""
    held = [b for r in sched.running for b in r.block_table]
    pool = sched.kv.pool
    referenced = sum(1 for b in pool.blocks if b.ref_count > 0)
    assert referenced + pool.num_free_blocks == pool.num_blocks
    assert len(set(held)) == referenced
    for r in sched.running:
        assert len(r.block_table) * sched.kv.block_size >= r.num_computed_tokens


def test_token_budget_chunks_prefills_and_decodes_go_first():
    sched = scheduler(max_num_batched_tokens=10)
    a, b = make(range(1, 9), arrival=0), make(range(11, 19), arrival=1)
    sched.add(a)
    sched.add(b)
    plan = step(sched)
    assert plan.num_new_tokens == [8, 2] and plan.sampled == [a]  # b's prompt is cut at the budget
    plan = step(sched)
    assert plan.requests[0] is a and plan.num_new_tokens == [1, 6]  # the decode first, then b's remaining chunk
    check_consistent(sched)


def test_unchunked_prefill_waits_for_a_step_with_room():
    sched = scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = make(range(1, 9)), make(range(11, 19), arrival=1)
    sched.add(a)
    sched.add(b)
    assert step(sched).requests == [a]
    assert step(sched).requests == [a, b]


def test_max_num_seqs_caps_running_requests():
    sched = scheduler(max_num_seqs=2)
    requests = [make([i + 1] * 3, arrival=i) for i in range(3)]
    for r in requests:
        sched.add(r)
    assert step(sched).requests == requests[:2]
    assert len(sched.running) == 2 and list(sched.waiting) == [requests[2]]


def test_preemption_never_leaves_a_preempted_request_in_the_plan():
    """The victim (highest priority value) was already placed in this step: it is taken out again and its tokens
    go back to the budget, so no step ever runs a request that lost its blocks."""
    sched = scheduler(num_blocks=8, block_size=4)
    low, high = make([5, 6, 7], max_tokens=24, priority=5), make([50, 51, 52, 53], max_tokens=24, priority=0, arrival=1)
    sched.add(low)
    sched.add(high)
    preempted = 0
    for _ in range(200):
        if not sched.has_work:
            break
        plan = step(sched)
        preempted += len(plan.preempted)
        assert not set(map(id, plan.preempted)) & set(map(id, plan.requests))
        check_consistent(sched)
    assert preempted > 0 and not sched.has_work
    assert low.num_output_tokens == high.num_output_tokens == 24


def test_a_step_that_preempts_admits_nothing_and_the_preempted_go_first():
    sched = scheduler(num_blocks=3, block_size=4)
    first, second = make([1, 2, 3], max_tokens=8, arrival=0), make([4, 5, 6], max_tokens=8, arrival=1)
    late = make([7, 8], max_tokens=2, arrival=2)
    for r in (first, second):
        sched.add(r)
    step(sched)
    sched.add(late)
    while not any(step(sched).preempted):
        pass
    assert sched.waiting[0].status is RequestStatus.PREEMPTED  # back at the head of the queue, before `late`
    assert late in sched.waiting


def test_a_request_waits_for_a_prefix_that_is_being_computed():
    sched = scheduler(num_blocks=32, block_size=4)
    shared = list(range(1, 13))
    writer, reader = make(shared + [40, 41], arrival=0), make(shared + [60], arrival=1)
    sched.add(writer)
    sched.add(reader)
    assert step(sched).requests == [writer]  # reader waits: 3 of its blocks are being computed
    plan = step(sched)
    assert reader in plan.requests and reader.num_cached_tokens == 12
    assert plan.num_new_tokens[plan.requests.index(reader)] == 1


def test_abort_of_a_swapped_request_frees_its_swap_space(llama):
    llm = LLM(llama, block_size=4, num_blocks=10, preemption_mode="swap", swap_space=1 << 20)
    ids = [llm.add_request([5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                           priority=i) for i in range(3)]
    engine = llm.engine
    while not any(r.status is RequestStatus.SWAPPED for r in engine.scheduler.waiting):
        llm.step()
    (swapped,) = [r for r in engine.scheduler.waiting if r.status is RequestStatus.SWAPPED]
    assert swapped.swapped_blocks and llm.abort(swapped.parent.request_id)
    assert swapped.finish_reason == "abort" and not swapped.swapped_blocks
    for rid in ids:
        llm.abort(rid)
    engine.check_idle()


def test_abort_ends_exactly_the_samples_of_one_request(llama):
    llm = LLM(llama)
    many = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
    a = llm.add_request([5, 6, 7], many, request_id="x")
    b = llm.add_request([5, 6, 7], many, request_id="x#0")  # an id that looks like a sample of "x"
    llm.step()
    assert llm.abort(a)
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished.setdefault(out.request_id, []).append(out.outputs[0].finish_reason)
    assert finished == {b: ["length"] * 3}
    llm.engine.check_idle()


def test_samples_waiting_to_fork_start_on_their_own_when_the_first_is_aborted(llama):
    engine = LLM(llama).engine
    group = engine.add_request([5, 6, 7, 8], SamplingParams(n=3, max_tokens=4, temperature=0.0, ignore_eos=True))
    first, *rest = group.samples
    assert first.forks == rest
    engine.scheduler.abort(first)
    while engine.has_unfinished:
        engine.step()
    assert [r.finish_reason for r in group.samples] == ["abort", "length", "length"]
    assert rest[0].output_token_ids == rest[1].output_token_ids  # greedy samples of one prompt agree
    engine.check_idle()


def test_automatic_ids_skip_ids_a_caller_chose(llama):
    llm = LLM(llama)
    mine = llm.add_request([5, 6], GREEDY, request_id="1")
    auto = [llm.add_request([5, 6], GREEDY) for _ in range(3)]
    assert mine == "1" and "1" not in auto and len(set(auto)) == 3


def test_a_whole_block_prompt_matching_a_prefix_in_flight_computes_its_own_last_token(llama):
    """A prompt of whole blocks that waits for its prefix (computed by a longer prompt in the same burst) must
    still compute its last token and sample from its own logits, not another request's row."""
    prefix = list(range(10, 42))  # 2 blocks of 16
    batch = [prefix + [7] * 40, list(range(100, 120)), prefix]
    together = LLM(llama).generate(batch, GREEDY, use_tqdm=False)
    alone = LLM(llama).generate([prefix], GREEDY, use_tqdm=False)[0]
    assert together[2].token_ids == alone.token_ids
    assert together[2].num_cached_tokens == 16  # one block reused, the last one computed


def test_no_progress_is_an_error_not_a_hang(llama):
    engine = LLM(llama, block_size=4, num_blocks=8).engine
    engine.add_request([5, 6, 7], GREEDY)
    engine.scheduler.kv.allocate_blocks(8)  # memory held by nothing the scheduler knows about
    with pytest.raises(RuntimeError, match="no progress"):
        engine.step()
