"""What the soak test draws (hf_paged/bench/soak_draw.py): reproducible rounds of requests within the soak's bounds,
a pool that is pressured but holds the biggest request, and `check_tokens`, which must flag a wrong ending."""
import random
from types import SimpleNamespace

import pytest

from hf_paged import SamplingParams
from hf_paged.bench import soak_draw
from hf_paged.bench.soak_check import Soak
from hf_paged.kv import blocks_needed

from conftest import cached_model

SYSTEMS = [[7] * n for n in soak_draw.SYSTEM_LENGTHS]


def test_a_round_is_reproducible_and_within_bounds():
    round_a = soak_draw.draw_round(random.Random("s/3"), SYSTEMS, 3, 200)
    assert round_a == soak_draw.draw_round(random.Random("s/3"), SYSTEMS, 3, 200)
    assert [s.rid for s in round_a] == [f"r3-{i}" for i in range(200)]
    for spec in round_a:
        assert 1 <= len(spec.prompt) <= soak_draw.MAX_PROMPT
        assert all(3 <= t < soak_draw.VOCAB for t in spec.prompt if t != 7)
        assert 1 <= spec.params.max_tokens <= soak_draw.MAX_NEW and 1 <= spec.params.n <= 4
        assert spec.abort_when in (None, "queued", "running", "preempted")
    prompts = [tuple(s.prompt) for s in round_a]
    assert any(p[:16] == (7,) * 16 for p in prompts)  # some start with a shared system prompt
    assert len(set(prompts)) < len(prompts)  # some are repeated verbatim
    assert {s.params.greedy for s in round_a} == {True, False}


def test_the_engine_is_pressured_but_holds_the_biggest_request():
    model = cached_model("llama", max_len=soak_draw.MAX_LEN)
    for number in range(6):
        rng = random.Random(number)
        specs = soak_draw.draw_round(rng, SYSTEMS, number, 40)
        options = soak_draw.draw_engine(rng, model, number, specs)
        biggest = max(blocks_needed(len(s.prompt) + s.params.max_tokens, options["block_size"]) for s in specs)
        assert biggest <= options["num_blocks"] <= biggest * 3 // 2
        assert options["preemption_mode"] == soak_draw.MODES[number % 3]
        assert ("swap_space" in options) == (options["preemption_mode"] != "recompute")


def ending(tokens, reason):
    return SimpleNamespace(token_ids=tokens, finish_reason=reason, index=0, error="boom")


@pytest.mark.parametrize("params, tokens, reason, bad", [
    (SamplingParams(max_tokens=3, ignore_eos=True), [5, 6, 7], "length", None),
    (SamplingParams(max_tokens=4, ignore_eos=True), [5, 6, 7], "length", "bad_lengths"),  # one short
    (SamplingParams(max_tokens=4), [5, soak_draw.EOS], "stop", None),
    (SamplingParams(max_tokens=4), [soak_draw.EOS, 5, 6, 7], "length", "bad_lengths"),  # ran past its EOS
    (SamplingParams(max_tokens=4, min_tokens=3), [5, soak_draw.EOS], "stop", "bad_lengths"),  # before min_tokens
    (SamplingParams(max_tokens=4, stop_token_ids=[9], ignore_eos=True), [5, 9], "stop", None),
    (SamplingParams(max_tokens=4), [5], "error", "errors"),
])
def test_check_tokens_flags_a_wrong_ending(params, tokens, reason, bad):
    soak = Soak()
    soak_draw.check_tokens(soak, soak_draw.Spec("r", [3, 4], params), ending(tokens, reason))
    flagged = {k for k in ("bad_lengths", "errors") if soak.counts[k]}
    assert flagged == ({bad} if bad else set()), soak.violations
