"""The soak test's weight-change sessions (hf_paged/bench/soak_sessions.py): a session runs on its own copy of the
model, every kind of weight change really changes the weights, and a round after a change gets a fresh reference."""
import random

import pytest
import torch

from hf_paged import SamplingParams
from hf_paged.bench import soak_sessions
from hf_paged.bench.soak_check import Soak, reference_engine
from hf_paged.bench.soak_draw import MAX_LEN, MAX_NEW, MAX_PROMPT, Spec
from hf_paged.kv import blocks_needed

from conftest import cached_model

OPTIONS = dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, enable_prefix_caching=False,
               attention_backend="torch")


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", soak_sessions.WEIGHT_CHANGES)
def test_every_kind_of_weight_change_changes_the_weights(kind, one_torch_thread):
    session = soak_sessions.start_session(cached_model("llama", max_len=MAX_LEN), OPTIONS, fp8=False, rounds=3)
    before = weights(session.model)
    reset = []
    session.llm.reset_prefix_cache = lambda: reset.append(True)
    rng = random.Random(next(seed for seed in range(100)
                             if random.Random(seed).choice(soak_sessions.WEIGHT_CHANGES) == kind))
    assert soak_sessions.change_weights(session.model, session.llm, rng) == kind
    changed = [not torch.equal(a, b) for a, b in zip(before, weights(session.model))]
    assert any(changed) and (kind == "one_tensor" or sum(changed) > 1)
    assert bool(reset) == (kind == "data_and_reset")  # .data writes are invisible: the prefix cache is reset by hand


def test_a_session_runs_on_a_copy_with_room_and_prefix_caching(one_torch_thread):
    model = cached_model("llama", max_len=MAX_LEN)
    session = soak_sessions.start_session(model, OPTIONS, fp8=False, rounds=2)
    assert session.model is not model and session.options["enable_prefix_caching"] and not session.fp8
    assert session.options["num_blocks"] >= blocks_needed(MAX_PROMPT + MAX_NEW, 4)
    soak = Soak()
    first = session.begin_round(soak, random.Random(0), reference_engine, 0)
    assert first == [] and session.reference is not None and soak.counts["weight_changes"] == 0
    spec = Spec("r0-1", [5, 6, 7], SamplingParams(max_tokens=2))
    session.end_round([spec])
    reference = session.reference
    again = session.begin_round(soak, random.Random(1), reference_engine, 1)
    assert [s.prompt for s in again] == [spec.prompt] and again[0].rid == "r1-again0"  # sent again, first
    assert soak.counts["weight_changes"] == 1 and session.reference is not reference  # built for the new weights
    assert soak.counts["weight_rounds"] == 2
