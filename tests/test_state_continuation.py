"""model/state_continuation.py: each state module class gets the cheapest continuation mode that is exact, checked
on its own inputs once per model (dtype, device): transformers' Mamba-1 scan, which starts any multi-token input
from a zero state, runs with every token's state kept; a module whose code continues a state runs as it is."""
import torch

from hf_paged.model.state_continuation import _close, continuation_modes
from hf_paged.model.state_layers import AS_IS, KEEP_STATES
from hf_paged.model.state_modules import find_state_modules
from hf_paged.tiny import tiny_hybrid


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
