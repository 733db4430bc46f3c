"""One round of the soak test (hf_paged/bench/soak_round.py): streamed requests with aborts, a generate() batch,
and a whole pressured round checked against the reference, on the tiny Llama."""
import random

from hf_paged import LLM, SamplingParams
from hf_paged.bench import soak_round
from hf_paged.bench.soak_check import Soak, reference_engine
from hf_paged.bench.soak_draw import MAX_LEN, SYSTEM_LENGTHS, Spec
from hf_paged.bench.soak_sessions import Context

from conftest import cached_model


def pressured(model):
    return LLM(model, block_size=4, num_blocks=24, max_num_batched_tokens=16, attention_backend="torch")


def test_a_streamed_round_ends_every_sample_once_and_aborts_as_drawn(one_torch_thread):
    model = cached_model("llama", max_len=MAX_LEN)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    specs = [Spec(f"r{i}", [3 + i] * (5 + 7 * i), params) for i in range(4)]
    specs.append(Spec("gone", [9] * 12, params, abort_when="running", abort_after=2))
    soak = Soak()
    ended, aborted = soak_round.run_stream(soak, pressured(model), specs, random.Random(0))
    assert not soak.violations and aborted == {"gone"} and soak.counts["aborts"] == 1
    assert sorted(ended) == [(f"r{i}", 0) for i in range(4)]
    assert all(len(c.token_ids) == 6 for c in ended.values())


def test_a_batch_round_gets_every_sample(one_torch_thread):
    model = cached_model("llama", max_len=MAX_LEN)
    specs = [Spec(f"b{i}", [3 + i] * 9, SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=i)) for i in range(3)]
    soak = Soak()
    ended, aborted = soak_round.run_batch(soak, pressured(model), specs)
    assert not soak.violations and not aborted
    assert sorted(ended) == sorted((f"b{i}", j) for i in range(3) for j in range(2))


def test_a_whole_round_matches_the_reference_and_counts_what_it_did(one_torch_thread):
    model = cached_model("llama", max_len=MAX_LEN)
    soak = Soak(seed=5)
    systems = [[random.Random(n).randrange(3, 256) for _ in range(n)] for n in SYSTEM_LENGTHS]
    ctx = Context(model, reference_engine(model))
    for number in range(3):  # one round per preemption mode
        soak_round.run_round(soak, ctx, number, systems, 12)
    assert not soak.violations
    assert soak.counts["rounds"] == soak.counts["stream_rounds"] + soak.counts["batch_rounds"] == 3
    assert 24 < soak.counts["requests"] <= 36  # a batch round leaves out the requests drawn to be aborted
    assert soak.counts["compared"] > 0 and soak.counts["steps"] > 0


def test_state_options_draw_checkpoints():
    drawn = [soak_round.draw_state_options(random.Random(i)) for i in range(40)]
    assert {d["state_checkpoints"] for d in drawn} == {None, 0, 1, 2, 6}
    assert {d["state_checkpoint_interval"] for d in drawn} == {1, 2, 4, 16}
