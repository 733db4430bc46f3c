"""What the soak test checks and counts (hf_paged/bench/soak_check.py): violations are counted (their messages
capped), outputs must equal the unpressured reference's per sample index, and the reference engine never preempts."""
from types import SimpleNamespace

import pytest

from hf_paged import SamplingParams
from hf_paged.bench import soak_check
from hf_paged.bench.soak_draw import MAX_LEN, Spec

from conftest import cached_model


def test_violations_are_counted_and_their_messages_capped():
    soak = soak_check.Soak()
    for i in range(60):
        soak.violate("lost", f"request {i}")
    assert soak.counts["lost"] == 60 and len(soak.violations) == 50 and soak.violations[0] == "request 0"
    assert set(soak_check.VIOLATION_COUNTS) <= set(soak_check.COUNTS)


class Reference:
    """An engine stand-in that returns fixed outputs (and can be made to preempt)."""

    def __init__(self, rows, preempts=False):
        self.rows, self.preemptions, self.preempts = rows, 0, preempts

    def stats(self):
        return {"num_preemptions": self.preemptions}

    def generate(self, prompts, params, use_tqdm=False):
        self.preemptions += self.preempts
        return [SimpleNamespace(outputs=[SimpleNamespace(index=i, token_ids=t, finish_reason=r)
                                         for i, (t, r) in enumerate(row)]) for row in self.rows]


def sample(tokens, reason="length"):
    return SimpleNamespace(token_ids=tokens, finish_reason=reason)


def test_outputs_must_equal_the_reference_per_sample():
    spec = Spec("a", [3, 4, 5], SamplingParams(max_tokens=3, n=2, temperature=0.0))
    reference = Reference([[([6, 7, 8], "length"), ([6, 7], "stop")]])
    soak = soak_check.Soak()
    soak_check.compare(soak, reference, [spec], {("a", 0): sample([6, 7, 8]), ("a", 1): sample([6, 7], "stop")},
                       {}, model=None)
    assert soak.counts["compared"] == 2 and not soak.violations
    # a sample that ends earlier than the reference's: no token to judge as a rounding flip, a mismatch
    soak_check.compare(soak, reference, [spec], {("a", 0): sample([6, 7], "stop")}, {}, model=None)
    assert soak.counts["mismatches"] == 1 and "differs from the unpressured run at output token 2" in soak.violations[0]
    soak_check.compare(soak, reference, [spec], {}, {}, model=None)  # nothing ended: counted as lost elsewhere
    assert soak.counts["compared"] == 3


def test_a_reference_that_preempts_is_an_error_of_the_soak_itself():
    spec = Spec("a", [3], SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="reference engine preempted"):
        soak_check.compare(soak_check.Soak(), Reference([[([6], "length")]], preempts=True), [spec], {}, {}, None)


def test_the_reference_engine_takes_every_request_at_once_and_keeps_every_block():
    model = cached_model("llama", max_len=MAX_LEN)
    llm = soak_check.reference_engine(model)
    assert soak_check.model_name(model) == "llama" and not soak_check.has_state(model)
    assert llm.engine.scheduler.release_window is None
    prompts = [[3 + i] * 200 for i in range(6)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["num_preemptions"] == 0
