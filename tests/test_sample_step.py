"""engine/sample_step.py: one result per request from a step's logits; a non-finite row or a failing sampling hook
ends only its own requests, and nothing changes a request."""
import torch

from hf_paged.engine.sample_step import sample_step
from hf_paged.request import Request, ParentRequest
from hf_paged.sampling import Sampler, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def make_request(controller=None):
    group = ParentRequest("r", 0, None, [1, 2])
    return Request(group, [1, 2], GREEDY, controller=controller)


class Hook:
    def __init__(self, fail=False):
        self.fail, self.seen = fail, []

    def process(self, requests, logits):
        self.seen.append(logits.clone())
        if self.fail:
            raise RuntimeError("hook broke")
        return [(0, True) for _ in requests]


def test_rows_are_sampled_natively_or_by_their_hook_in_request_order():
    hook = Hook()
    requests = [make_request(), make_request(hook), make_request()]
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    results = sample_step(Sampler(torch.device("cpu"), seed=0), requests, logits)
    assert [(r.token, r.stop_now, r.error) for r in results] == [(1, False, None), (0, True, None), (2, False, None)]
    assert len(hook.seen) == 1 and torch.equal(hook.seen[0], logits[1:2])  # only its own rows
    assert all(r.output_token_ids == [] for r in requests)  # the scheduler applies the results, not this


def test_a_non_finite_row_ends_only_its_request():
    requests = [make_request(), make_request(), make_request()]
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [2.0, float("inf")]])
    results = sample_step(Sampler(torch.device("cpu"), seed=0), requests, logits)
    assert results[0].token == 1 and results[0].error is None
    assert all(r.non_finite and r.token is None and "non-finite" in r.error for r in results[1:])


def test_a_failing_hook_ends_only_the_requests_it_samples():
    broken = Hook(fail=True)
    requests = [make_request(broken), make_request(), make_request(broken)]
    results = sample_step(Sampler(torch.device("cpu"), seed=0), requests, torch.tensor([[0.0, 1.0]] * 3))
    assert results[1].token == 1 and results[1].error is None
    assert [r.error for r in (results[0], results[2])] == ["RuntimeError: hook broke"] * 2
    assert not results[0].non_finite and len(broken.seen[0]) == 2  # one call for the hook's two requests


def test_bf16_logits_of_a_greedy_step_give_the_float32_picks_and_flags():
    """A greedy step hands its bf16 logits over uncast: the same first maxima, non-finite rows flagged, and a row whose
    sum only a bf16 accumulator would overflow is finite."""
    requests = [make_request() for _ in range(4)]
    big = torch.finfo(torch.bfloat16).max
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [big, 1e36, 0.0, 0.0], [1.0, float("nan"), 0.0, 0.0],
                           [-3.0, -2.0, float("-inf"), -2.5]]).to(torch.bfloat16)
    assert torch.isinf(logits[1].sum()) and torch.isfinite(logits[1].float().sum())
    results = sample_step(Sampler(torch.device("cpu"), seed=0), requests, logits)
    want = sample_step(Sampler(torch.device("cpu"), seed=0), requests, logits.float())
    assert [(r.token, r.error) for r in results] == [(r.token, r.error) for r in want]
    assert [r.token for r in results] == [1, 0, None, None] and results[2].non_finite and results[3].non_finite
