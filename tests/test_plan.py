"""engine/plan.py: a step plan's token count and its add / remove, and the preemption cost model behind
preemption_mode="auto"."""
from hf_paged.engine.plan import PreemptionCosts, StepPlan


def test_a_plan_counts_its_tokens_and_takes_a_request_back_out():
    a, b, c = object(), object(), object()
    plan = StepPlan()
    plan.add(a, 5)
    plan.add(b, 1)
    plan.add(c, 3)
    assert plan.num_tokens == 9
    assert plan.remove(b) == 1 and plan.requests == [a, c] and plan.num_new_tokens == [5, 3]
    assert plan.remove(b) == 0 and plan.num_tokens == 8  # not in the plan: nothing removed


def test_swap_is_cheaper_only_when_moving_the_bytes_out_and_back_beats_recomputing():
    costs = PreemptionCosts(copy_bytes_per_s=1e9, prefill_tokens_per_s=1000.0)
    assert costs.swap_is_cheaper(num_bytes=10**6, num_tokens=100)  # 2 ms against 100 ms
    assert not costs.swap_is_cheaper(num_bytes=10**8, num_tokens=100)  # 200 ms against 100 ms


def test_only_prefill_sized_steps_update_the_throughput_average():
    costs = PreemptionCosts()
    costs.observe_step(8, 0.001)  # a decode step: says nothing about prefill
    assert costs.prefill_tokens_per_s is None
    costs.observe_step(100, 1.0)
    costs.observe_step(300, 1.0)
    assert costs.prefill_tokens_per_s == 200.0
    costs.observe_step(100, 0.0)  # no time measured: ignored
    assert costs.prefill_tokens_per_s == 200.0
