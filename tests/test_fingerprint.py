"""model/fingerprint.py: the value that keys the prefix cache changes whenever what produced the K/V may have:
tensors replaced, given new storage, cast, put straight into a module's dicts, and train / eval mode."""
import pytest
import torch

from hf_paged.model.fingerprint import weights_fingerprint
from hf_paged.tiny import tiny_model


@pytest.fixture
def model():
    return tiny_model("llama", seed=3)


def test_the_fingerprint_sees_replaced_moved_and_cast_tensors(model):
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    layer = model.model.layers[0].mlp.up_proj
    old = layer.weight
    layer.weight = torch.nn.Parameter(old.detach().clone())  # the old one is still alive: compared by identity
    assert weights_fingerprint(model) != before
    again = weights_fingerprint(model)
    layer.weight.data = layer.weight.data.clone()  # new storage through .data
    assert weights_fingerprint(model) != again
    again = weights_fingerprint(model)
    model.model.layers[0].post_attention_layernorm.to(torch.float64)
    assert weights_fingerprint(model) != again
    again = weights_fingerprint(model)
    model.train()
    assert weights_fingerprint(model) != again


def test_a_tensor_put_into_a_private_dict_is_seen(model):
    """accelerate's set_module_tensor_to_device writes `module._parameters[name]` directly (no registration hook)."""
    before = weights_fingerprint(model)
    proj = model.model.layers[0].self_attn.q_proj
    proj._parameters["weight"] = torch.nn.Parameter(proj.weight.detach() * 2)
    assert weights_fingerprint(model) != before
