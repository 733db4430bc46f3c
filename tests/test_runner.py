"""engine/runner.py: how a step plan is packed into one varlen forward (tokens, positions, K/V slots, which rows are
sampled, HF's right-padding query) and how sampled rows map back to requests (forks share their parent's row). The
packing is checked without running the model; parity of the forward itself is the feature suites' business."""
import pytest
import torch

from hf_paged import LLM
from hf_paged.engine.plan import StepPlan
from hf_paged.kv import NULL_BLOCK
from hf_paged.request import Request, ParentRequest
from hf_paged.sampling import Sampler, SamplingParams
from hf_paged.tiny import tiny_model

from conftest import cached_model

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner():
    return LLM(cached_model("llama"), block_size=4, num_blocks=16, attention_backend="torch",
               cuda_graphs=False).engine.runner


def make(prompt, table, computed=0, outputs=()):
    group = ParentRequest("r", 0, None, list(prompt))
    request = Request(group, list(prompt), GREEDY, output_token_ids=list(outputs))
    request.block_table, request.num_computed_tokens = list(table), computed
    group.samples.append(request)
    return request


def test_a_step_packs_a_decode_and_a_prompt_chunk(runner):
    decode = make([5, 6, 7, 8, 9], [3, 4], computed=5, outputs=[10])  # its 6th token runs, at position 5
    chunk = make(list(range(20, 30)), [7, 2, 9], computed=0)  # 6 of its 10 prompt tokens run: nothing sampled
    plan = StepPlan(requests=[decode, chunk], num_new_tokens=[1, 6])
    inputs = runner.prepare(plan)
    assert inputs.input_ids.tolist() == [[10, 20, 21, 22, 23, 24, 25]]
    assert inputs.position_ids.tolist() == [[5, 0, 1, 2, 3, 4, 5]]
    assert inputs.metadata.slot_mapping.tolist() == [4 * 4 + 1, 28, 29, 30, 31, 8, 9]
    assert inputs.sampled == [0] and inputs.sample_rows.tolist() == [0]


def test_a_right_padded_prompt_adds_one_query_that_stores_nothing(runner):
    padded = make([5, 6, 7, 0], [3], computed=0)
    padded.first_query = (7, 2)
    inputs = runner.prepare(StepPlan(requests=[padded], num_new_tokens=[4]))
    assert inputs.input_ids.tolist() == [[5, 6, 7, 0, 7]] and inputs.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    assert inputs.metadata.slot_mapping.tolist()[-1] == NULL_BLOCK * 4  # its K/V go to the null block
    assert inputs.sample_rows.tolist() == [4]


def test_forked_samples_take_their_parents_row(runner, monkeypatch):
    parent, other = make([5, 6, 7], [3]), make([8, 9], [4])
    child = make([5, 6, 7], [3])
    plan = StepPlan(requests=[parent, other], num_new_tokens=[3, 2], sampled=[parent, other, child],
                    sample_sources=[0, 1, 0])

    def execute(inputs, greedy=None, fast=True, keep_dtype=False):  # no forward: row j's logits peak at its packed row
        rows = inputs.sample_rows.tolist()
        logits = torch.zeros(len(rows), 16)
        logits[torch.arange(len(rows)), torch.tensor(rows)] = 1.0
        return logits

    monkeypatch.setattr(runner, "execute", execute)
    outcome = runner.run(plan, Sampler(torch.device("cpu"), seed=0))
    assert [r.token for r in outcome.results] == [2, 4, 2]


def test_forked_samples_take_their_parents_pick(runner, monkeypatch):
    """The same when the LM head gave picks instead of logits (model/greedy_head.py)."""
    parent, other = make([5, 6, 7], [3]), make([8, 9], [4])
    child = make([5, 6, 7], [3])
    plan = StepPlan(requests=[parent, other], num_new_tokens=[3, 2], sampled=[parent, other, child],
                    sample_sources=[0, 1, 0])

    class Step:
        token_ids = None

    step = Step()

    def execute(inputs, greedy=None, fast=True, keep_dtype=False):
        greedy.token_ids = inputs.sample_rows.clone()  # sampled row j picks the packed row it came from
        return None

    monkeypatch.setattr(runner, "greedy_step", lambda plan, inputs: step)
    monkeypatch.setattr(runner, "execute", execute)
    outcome = runner.run(plan, Sampler(torch.device("cpu"), seed=0))
    assert [r.token for r in outcome.results] == [2, 4, 2] and runner.greedy_picks == 1


@pytest.mark.parametrize("how", ["greedy", "sampled", "logprobs"])
def test_argmax_only_steps_sample_a_bf16_models_logits_uncast(monkeypatch, how):
    """A step whose requests all take the first maximum hands the sampler the logits in the model's dtype (casting
    bf16 to float32 moves no maximum; 17 ms a step for a 151,936-token head at 64 rows); a step with a sampled row or
    one that wants log-probs gets them in float32. The greedy tokens are those of the cast logits."""
    import hf_paged.engine.runner as runner_module

    monkeypatch.setenv("HF_PAGED_GREEDY_HEAD", "0")  # the head's logits reach the sampler
    model = tiny_model("llama").to(torch.bfloat16)  # a model of its own: the cached one is shared
    seen = []
    original = runner_module.sample_step
    monkeypatch.setattr(runner_module, "sample_step",
                        lambda sampler, requests, logits: seen.append(logits.dtype) or original(sampler, requests,
                                                                                                logits))
    prompts = [[5, 9, 14, 3, 22, 7], [8, 1, 30, 2]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    other = {"greedy": greedy, "sampled": SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True),
             "logprobs": SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)}[how]
    outputs = LLM(model).generate(prompts, [greedy, other])
    assert set(seen) == {torch.bfloat16 if how == "greedy" else torch.float32}
    if how == "greedy":
        monkeypatch.setattr(runner_module, "picks_by_argmax", lambda params, banned: False)  # every step cast
        again = LLM(model).generate(prompts, [greedy, other])
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
        assert seen[-1] == torch.float32
