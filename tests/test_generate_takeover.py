"""`generate(..., cache_implementation="paged")` behaves exactly like HF's own `generate`.

Every comparison is exact: the tiny models are sharpened (`hf_paged.tiny`), so greedy margins are wide and
fp reordering between the engine and HF cannot flip a token. Every paged call is also checked to have run
on the engine (a silent fall-back to HF's loop would make the equality checks meaningless).
"""
from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList)

import hf_paged

from takeover_helpers import (EOS, PAD, assert_ragged, batch, make_tokenizer, model_for, on_engine, paged, ragged_eos, state)  # noqa: F401


# ---- 1. the three ways to ask for "paged"; configs untouched ------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_kwarg_left_padded_mixed_lengths(arch, engine_runs):
    model = model_for(arch)
    ids, mask = batch((3, 7, 12))  # gemma2's sliding window is 8: prompt + output exceed it
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref)


def test_generation_config_argument(engine_runs):
    model = model_for()
    ids, mask = batch((4, 9))
    config = GenerationConfig(cache_implementation="paged", max_new_tokens=8, do_sample=False,
                              repetition_penalty=1.3, pad_token_id=PAD, eos_token_id=EOS)
    before = config.to_dict()
    reference = copy.deepcopy(config)
    reference.cache_implementation = None
    ref = model.generate(ids, attention_mask=mask, generation_config=reference)
    with on_engine(engine_runs, model):
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    assert torch.equal(out, ref)
    assert config.to_dict() == before, "the caller's GenerationConfig was modified"


def test_model_generation_config(engine_runs):
    model = model_for()
    ids, mask = batch((5, 2, 8), seed=1)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    model.generation_config.cache_implementation = "paged"
    try:
        with on_engine(engine_runs, model):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        # a kwarg still wins over the model's default
        with on_engine(engine_runs, model, expected=0):
            plain = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                   cache_implementation="dynamic")
        # a passed GenerationConfig that leaves cache_implementation unset inherits the model's "paged", as in HF
        with on_engine(engine_runs, model):
            inherited = model.generate(ids, attention_mask=mask,
                                       generation_config=GenerationConfig(max_new_tokens=8, do_sample=False))
    finally:
        model.generation_config.cache_implementation = None
    assert torch.equal(out, ref)
    assert torch.equal(plain, ref)
    assert torch.equal(inherited, ref)


class Boom(LogitsProcessor):
    def __init__(self, at_length):
        self.at_length = at_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.at_length:
            raise ValueError("boom")
        return scores


def test_raising_processor_leaves_model_untouched(engine_runs):
    """HF propagates the processor's own exception; so must the paged path, leaving the model as it was."""
    model = model_for()
    ids, mask = batch((3, 6))
    processors = LogitsProcessorList([Boom(ids.shape[1] + 3)])
    with pytest.raises(ValueError, match="boom"):
        model.generate(ids, attention_mask=mask, max_new_tokens=8, logits_processor=processors)
    with pytest.raises(ValueError, match="boom"):
        with on_engine(engine_runs, model):
            model.generate(ids, attention_mask=mask, max_new_tokens=8, logits_processor=processors,
                           cache_implementation="paged")
    # the model still works afterwards, on both paths
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)


# ---- 4. HF's own loop on a PagedCache: beam search -----------------------------------------------------------------------
def test_beam_search_runs_in_hf_loop_on_paged_cache(engine_runs, caplog):
    model = model_for()
    ids, mask = batch((3, 7))
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        with on_engine(engine_runs, model, expected=0):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False,
                                 cache_implementation="paged")
    assert torch.equal(out, ref)
    warnings = [r for r in caplog.records if r.name == "hf_paged" and r.levelno == logging.WARNING]
    assert any("beam" in r.getMessage() and "on a PagedCache" in r.getMessage() for r in warnings), \
        [r.getMessage() for r in caplog.records]


def test_custom_position_ids_fall_back(engine_runs, caplog):
    """The engine numbers positions itself; the caller's own position_ids (absolute embeddings in gpt2) need
    HF's loop."""
    model = model_for("gpt2")
    ids = torch.tensor([[5, 6, 7, 8]])
    positions = torch.arange(4)[None] + 5
    ref = model.generate(ids, position_ids=positions, max_new_tokens=6, do_sample=False)
    assert not torch.equal(ref, model.generate(ids, max_new_tokens=6, do_sample=False))
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        with on_engine(engine_runs, model, expected=0):
            out = model.generate(ids, position_ids=positions, max_new_tokens=6, do_sample=False,
                                 cache_implementation="paged")
    assert torch.equal(out, ref)
    assert any("position_ids" in r.getMessage() for r in caplog.records if r.name == "hf_paged")


# ---- 5. disable / enable -----------------------------------------------------------------------------
def test_disable_reaches_transformers_own_paged_path(engine_runs, monkeypatch):
    model = model_for()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    calls = []

    def fake_generate_batch(inputs, generation_config=None, **kwargs):
        calls.append(inputs)
        return {f"req_{i}": SimpleNamespace(prompt_ids=row, generated_tokens=[42]) for i, row in enumerate(inputs)}

    monkeypatch.setattr(model, "generate_batch", fake_generate_batch, raising=False)
    hf_paged.disable()
    try:
        assert not hf_paged.is_enabled()
        out = model.generate(ids, max_new_tokens=3, cache_implementation="paged")
        assert calls == [ids.tolist()], "transformers' own continuous batching was not reached"
        assert out.shape == (1, 2, 4) and (out[0, :, -1] == 42).all()
        assert not engine_runs
    finally:
        hf_paged.enable()
    assert hf_paged.is_enabled()
    ref = model.generate(ids, max_new_tokens=3, do_sample=False)
    out = paged(model, engine_runs, ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref) and len(calls) == 1


def test_a_call_describes_the_model_once(engine_runs, monkeypatch):
    """The take-over describes the model before it decides where the call runs, and the engine it builds takes that
    description instead of making its own (describing costs a forward lock, module scans and signature reads)."""
    from hf_paged.engine import engine as engine_module
    from hf_paged.integrations import generate as generate_module

    calls = []
    original = generate_module.describe_model

    def counting(model):
        calls.append(model)
        return original(model)

    monkeypatch.setattr(generate_module, "describe_model", counting)
    monkeypatch.setattr(engine_module, "describe_model", counting)
    model = model_for()
    ids, mask = batch((4, 9))
    paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert len(calls) == 1
