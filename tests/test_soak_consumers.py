"""The soak test's consumers (hf_paged/bench/soak_consumers.py): how a round's requests are dealt between them, that
a sample ending twice or after its abort is a violation, and a real run of four kinds of consumer on one LLM."""
import random

from hf_paged import LLM, SamplingParams
from hf_paged.bench import soak_consumers
from hf_paged.bench.soak_check import Soak
from hf_paged.bench.soak_draw import MAX_LEN, Spec

from conftest import cached_model


def specs(count, aborted=()):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    return [Spec(f"r{i}", [3 + i, 4, 5], params, abort_when="queued" if i in aborted else None) for i in range(count)]


def test_requests_to_abort_go_to_the_one_step_loop_and_every_request_to_one_consumer():
    for seed in range(20):
        shares = soak_consumers.split_consumers(random.Random(seed), specs(30, aborted={2, 9}), 6)
        kinds = [kind for kind, _ in shares]
        assert kinds.count("step") <= 1 and kinds.count("astream") <= 1
        dealt = [s.rid for _, share in shares for s in share]
        step = [s.rid for kind, share in shares if kind == "step" for s in share]
        assert {"r2", "r9"} <= set(step)
        assert sorted(dealt) == sorted(s.rid for s in specs(30))


def test_without_a_step_loop_nothing_is_aborted():
    without = 0
    for seed in range(20):
        shares = soak_consumers.split_consumers(random.Random(seed), specs(10, aborted={1}), 2)
        if "step" not in [kind for kind, _ in shares]:
            without += 1
            assert sorted(s.rid for _, share in shares for s in share) == [f"r{i}" for i in range(10) if i != 1]
    assert without  # two of four kinds: some seeds leave the step loop out


def test_a_sample_that_ends_twice_or_after_its_abort_is_a_violation():
    soak, ended = Soak(), {}
    spec = specs(1)[0]
    done = type("Completion", (), {"index": 0})()
    soak_consumers.finish_event(soak, ended, spec, done, set())
    assert ended == {("r0", 0): done} and not soak.violations
    soak_consumers.finish_event(soak, ended, spec, done, set())
    soak_consumers.finish_event(soak, {}, spec, done, {"r0"})
    assert soak.counts["duplicated"] == 2


def test_four_consumers_on_one_llm_each_get_their_own_results(one_torch_thread):
    llm = LLM(cached_model("llama", max_len=MAX_LEN), block_size=4, num_blocks=64, attention_backend="torch")
    kinds = ("generate", "stream", "astream", "step")
    shares = [(kind, [Spec(f"{kind}{i}", [3 + i, 10 + k, 5], SamplingParams(max_tokens=4, temperature=0.0,
                                                                              ignore_eos=True)) for i in range(3)])
              for k, kind in enumerate(kinds)]

    def step_loop(llm, share):
        for spec in share:
            llm.add_request(spec.prompt, spec.params, request_id=spec.rid)
        ended = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                for completion in out.outputs:
                    if completion.finish_reason is not None:
                        ended[(out.request_id, completion.index)] = completion
        return ended, set()

    soak = Soak()
    ended, aborted = soak_consumers.run_consumers(soak, llm, shares, step_loop)
    assert not soak.violations and not aborted
    assert sorted(ended) == sorted((s.rid, 0) for _, share in shares for s in share)
    assert all(len(c.token_ids) == 4 for c in ended.values())
