"""model/state_continuation.py: each state module class gets the cheapest continuation mode that is exact, checked
on its own inputs once per model (dtype, device): transformers' Mamba-1 scan, which starts any multi-token input
from a zero state, runs with every token's state kept; a module whose code continues a state runs as it is."""
import pytest
import torch

import hf_paged
import hf_paged.model.spec as model_spec
from hf_paged.model.own_state import own_state_modules
from hf_paged.model.state_continuation import _close, continuation_modes
from hf_paged.model.state_layers import AS_IS, KEEP_STATES, TOKEN_BY_TOKEN
from hf_paged.model.state_modules import find_state_modules
from hf_paged.tiny import tiny_hybrid

from test_hybrid_engine import CONV_RESTART, FAMILIES, MAMBA_1, strong_state


def modes(model_type):
    model = tiny_hybrid(model_type)
    found = find_state_modules(model)
    got = continuation_modes(model, found)
    assert set(got) == set(found)
    return model, found, got


def test_a_mamba_scan_keeps_every_tokens_state_and_the_answer_is_kept_on_the_model():
    model, found, got = modes("mamba")
    assert set(got.values()) == {KEEP_STATES}
    (key, known), = model.__dict__["_hf_paged_continuation"].items()
    assert key == ("torch.float32", "cpu") and known == got and continuation_modes(model, found) is known


def test_short_convolutions_that_continue_a_state_run_as_they_are():
    _, _, got = modes("lfm2")
    assert set(got.values()) == {AS_IS}
    assert continuation_modes(torch.nn.Linear(2, 2), {}) == {}


def test_close_is_relative_to_the_largest_output_and_nan_is_never_close():
    want = torch.tensor([100.0, 1.0])
    assert _close(want + 0.05, want, 1e-3) and not _close(want + 0.5, want, 1e-3)
    assert not _close(torch.tensor([float("nan"), 1.0]), want, 1e-3)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_state_module_continues_in_the_cheapest_exact_mode(model_type):
    """Mamba-1 mixers continue a state only when asked to keep every token's state (their recurrent form),
    recurrent_gemma's recurrent blocks only token by token; every other family's module continues it as it is, at no
    cost."""
    model = tiny_hybrid(model_type)
    if model_type in MAMBA_1:
        strong_state(model)
    modes = set(continuation_modes(model, {**find_state_modules(model), **own_state_modules(model)}).values())
    assert modes == ({KEEP_STATES} if model_type in MAMBA_1 else {TOKEN_BY_TOKEN} if model_type in CONV_RESTART
                     else {AS_IS})


@pytest.mark.parametrize("model_type", ("mamba", "falcon_mamba"))
def test_a_state_layer_that_drops_its_state_between_pieces_is_refused(model_type, monkeypatch):
    """Left to run its continuations as it is, a Mamba-1 model's paged forward equals its own forward fed the same
    pieces on transformers' cache, both wrong: the start-up check compares with its forward on the whole prefix and
    refuses it, saying why."""
    monkeypatch.setattr(model_spec, "continuation_modes", lambda model, state: dict.fromkeys(state, AS_IS))
    model = tiny_hybrid(model_type)
    strong_state(model)
    with pytest.raises(ValueError, match=rf"'{model_type}'.*drops its previous state for a multi-token input"):
        hf_paged.LLM(model)
