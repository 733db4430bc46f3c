"""integrations/generate.py, its decisions as functions: whether a call asks for "paged" (as HF resolves it), options
overridden for one call only, the engine options checked up front, which masks the engine can serve, and the mask
HF infers. (The take-over itself is test_generate_takeover.py's and test_generate_options.py's.)"""
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from hf_paged.config import InputTypeError
from hf_paged.integrations.generate import (_cache_config, _engine_mask_reason, _inferred_mask, _set_option,
                                            wants_paged)


def model_with(**generation):
    return SimpleNamespace(generation_config=GenerationConfig(**generation))


def test_paged_is_asked_by_kwarg_then_passed_config_then_the_models_default():
    model = model_with(cache_implementation="paged")
    assert wants_paged(model, {}) and not wants_paged(model, {"cache_implementation": "static"})
    assert not wants_paged(model, {}, GenerationConfig(cache_implementation="dynamic"))
    assert wants_paged(model_with(), {"cache_implementation": "paged"}) and not wants_paged(model_with(), {})


def test_an_option_is_overridden_for_this_call_only():
    config = GenerationConfig(max_new_tokens=5)
    arguments, extra = {"generation_config": config}, {"max_new_tokens": 5}
    _set_option(arguments, extra, "max_new_tokens", 9)
    assert arguments["generation_config"].max_new_tokens == 9 and extra["max_new_tokens"] == 9
    assert config.max_new_tokens == 5  # the caller's config is not modified
    bare = {}
    _set_option({}, bare, "do_sample", False)
    assert bare == {"do_sample": False}


def test_engine_options_are_checked_up_front():
    model = model_with()
    assert _cache_config(model, {}, {}, None) is None
    assert _cache_config(model, {}, {"cache_config": {"block_size": 8}}, None) == {"block_size": 8}
    with pytest.raises(InputTypeError, match="cache_config must be a dict"):
        _cache_config(model, {}, {"cache_config": 8}, None)
    with pytest.raises(ValueError, match="unknown hf_paged engine option"):
        _cache_config(model, {}, {"cache_config": {"blok_size": 8}}, None)
    with pytest.raises(ValueError, match="max_model_len=64 exceeds"):
        _cache_config(model, {}, {"cache_config": {"max_model_len": 64}}, 32)


def test_which_masks_the_engine_serves():
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert _engine_mask_reason(left, windowed=True, takes_positions=False) is None
    assert _engine_mask_reason(right, windowed=False, takes_positions=True) is None
    assert "right padding" in _engine_mask_reason(right, windowed=False, takes_positions=False)
    assert "sliding-window" in _engine_mask_reason(right, windowed=True, takes_positions=True)
    assert "not 0/1" in _engine_mask_reason(torch.tensor([[2, 1]]), False, True)
    assert "no real token" in _engine_mask_reason(torch.tensor([[0, 0], [1, 1]]), False, True)


def test_the_inferred_mask_marks_pad_tokens_unless_pad_is_eos():
    inputs = torch.tensor([[0, 5, 6], [7, 8, 9]])
    assert _inferred_mask(inputs, SimpleNamespace(pad_token_id=0, eos_token_id=2)).tolist() == [[0, 1, 1], [1, 1, 1]]
    assert _inferred_mask(inputs, SimpleNamespace(pad_token_id=0, eos_token_id=[2, 0])) is None
    assert _inferred_mask(inputs[1:], SimpleNamespace(pad_token_id=0, eos_token_id=2)) is None  # no padding at all
