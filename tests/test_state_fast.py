"""Faster forwards of Gated DeltaNet / short-convolution state modules (`model.state_fast`, `model.gated_delta`):
taken only where they agree with the module's own forward, exact against HF where taken (also under chunking,
preemption and prefix hits), invisible outside the engine's state runs."""
from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.model import state_fast
from hf_paged.model.state_modules import find_state_modules
from hf_paged.tiny import tiny_hybrid

from conftest import assert_same_as_hf, exact_under_pressure, left_padded_batch, wrong_substitute_refused

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GATED_DELTA = ("qwen3_5_text", "qwen3_next", "olmo_hybrid")  # every substitute
CONV_ONLY = ("lfm2", "mamba2")  # the short convolution's step only
RECURRENT, CONV, CHUNK = "torch_recurrent_gated_delta_rule", "causal_conv1d_forward", "torch_chunk_gated_delta_rule"


def spy(monkeypatch, name: str) -> list:
    """Counts the calls of the substitute for `name` in the fast forwards built from now on."""
    calls, make = [], state_fast.SUBSTITUTES[name]

    def counted(original):
        substitute = make(original)

        def call(*args, **kwargs):
            calls.append(1)
            return substitute(*args, **kwargs)
        return call
    monkeypatch.setitem(state_fast.SUBSTITUTES, name, counted)
    return calls


@pytest.mark.parametrize("model_type", GATED_DELTA + CONV_ONLY)
def test_fast_forward_is_exact_where_taken(monkeypatch, always_fast, model_type):
    """With the timing skipped, every module of the family takes the substitutes (they agree with its own forward),
    the engine's prefills and decodes run through them, and the tokens are HF's on a left-padded batch."""
    calls = {name: spy(monkeypatch, name) for name in (RECURRENT, CONV, CHUNK)}
    model = tiny_hybrid(model_type)
    paths = state_fast.fast_paths(model, find_state_modules(model))
    assert paths and all(path is not None for path in paths.values())
    ids, mask = left_padded_batch([5, 11, 17])
    assert_same_as_hf(model, ids, mask, max_new_tokens=12, do_sample=False)
    assert calls[CONV]
    assert model_type in CONV_ONLY or (calls[RECURRENT] and calls[CHUNK])


def test_fast_forward_exact_under_pressure(always_fast):
    """Chunked prefill smaller than a prompt (continuations through the chunked rule), preemption by recompute and
    by swap, prefix hits (the state restored from a checkpoint): the tokens of HF alone."""
    exact_under_pressure(tiny_hybrid("qwen3_5_text"), seed=3)


@pytest.mark.parametrize("name,wrong", [
    (RECURRENT, lambda step: lambda q, k, v, g, beta, **kw: step(q, k, v, torch.zeros_like(g), beta, **kw)),
    (CHUNK, lambda rule: lambda q, k, v, g, beta, **kw: rule(q, k, v, g, beta * 0.5, **kw)),
    (CONV, lambda step: lambda conv1d, x, *a, **kw: step(conv1d, x.flip(1), *a, **kw)),
])
def test_a_wrong_substitute_is_not_taken(monkeypatch, always_fast, name, wrong):
    """A substitute that computes something else (no decay, half the learning rate, channels mixed up) fails the
    agreement check: the module keeps its own forward and the engine stays exact."""
    wrong_substitute_refused(monkeypatch, name, wrong, "qwen3_5_text")


def test_a_modules_trial_runs_count_as_recorded_trial_calls(monkeypatch):
    """A step in which a state module's substitutes are checked and timed is not a step of chosen paths only."""
    from hf_paged import trials

    monkeypatch.delenv(state_fast.SWITCH, raising=False)
    counts = []
    original = state_fast._Trial.agrees
    monkeypatch.setattr(state_fast._Trial, "agrees",
                        lambda self, *args: counts.append(trials.recorded.calls) or original(self, *args))
    before = trials.recorded.calls
    hf_paged.LLM(tiny_hybrid("qwen3_next")).generate([[5, 9, 14, 3, 22, 7]], hf_paged.SamplingParams(max_tokens=2))
    assert counts and counts[0] > before


def test_switch_own_keeps_the_modules_forward(monkeypatch):
    monkeypatch.setenv(state_fast.SWITCH, "own")
    model = tiny_hybrid("qwen3_next")
    assert all(path is None for path in state_fast.fast_paths(model, find_state_modules(model)).values())


def test_transformers_and_plain_forwards_untouched(always_fast):
    """The fast forward is a copy with globals of its own: transformers' module functions and the class forward stay
    what they were, and a plain forward after an engine run gives what it gave before."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    before = {name: getattr(modeling, name) for name in map(state_fast.modeling_name, state_fast.SUBSTITUTES)
              if hasattr(modeling, name)}
    model = tiny_hybrid("qwen3_5_text")
    forward = type(model.model.layers[0].linear_attn).forward
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        plain = model(ids).logits
    llm = hf_paged.LLM(model, num_blocks=32, block_size=4)
    llm.generate([[5, 6, 7]], hf_paged.SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert {name: getattr(modeling, name) for name in before} == before
    assert type(model.model.layers[0].linear_attn).forward is forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain)


@pytest.mark.parametrize("model_type", GATED_DELTA)
def test_bf16_models_pass_the_start_up_check_with_the_substitutes(always_fast, model_type):
    """In bf16 the substitutes sum the convolution in fp32 (as a convolution does): the model's paged forward stays
    within the start-up check's tolerance of its own (summed in bf16, qwen3_next's drifted past it and was refused)."""
    model = tiny_hybrid(model_type, dtype=torch.bfloat16)
    assert all(path is not None for path in state_fast.fast_paths(model, find_state_modules(model)).values())
    llm = hf_paged.LLM(model, num_blocks=32, block_size=4)
    out = llm.generate([[5, 6, 7, 8]], hf_paged.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_model_refused_with_the_substitutes_is_checked_again_on_its_own_forwards(monkeypatch, always_fast):
    """Where the whole model's start-up check refuses it with the substitutes in (each agreed with its module alone),
    the engine describes it again with every state module on its own forward, checks that, and serves it: HF's
    tokens, no substitute called."""
    from hf_paged.engine import engine as engine_module

    checked = []
    original = engine_module.check_paged_matches_model

    def refuse_substituted(model, spec, backends):
        checked.append(spec.substituted)
        if spec.substituted:
            raise ValueError("model type 'qwen3_5_text': as if the substitutes drifted past the tolerance")
        return original(model, spec, backends)

    monkeypatch.setattr(engine_module, "check_paged_matches_model", refuse_substituted)
    model = tiny_hybrid("qwen3_5_text", seed=4)
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    assert checked == [True, False] and not llm.engine.spec.substituted
    calls = {name: spy(monkeypatch, name) for name in (RECURRENT, CONV, CHUNK)}
    ids, mask = left_padded_batch([5, 11])
    assert_same_as_hf(model, ids, mask, max_new_tokens=6, do_sample=False)
    out = llm.generate([[5, 6, 7, 8, 9]], hf_paged.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and not any(calls.values())
