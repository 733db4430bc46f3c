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


class StandInLora(torch.nn.Module):
    """A PEFT adapter layer as the fingerprint sees one: `_active_adapter` and the adapter tensors under
    `adapter_layer_names` (PEFT's LoraLayer lists lora_A / lora_B / lora_embedding_* / lora_magnitude_vector)."""

    adapter_layer_names = ("lora_A", "lora_B")

    def __init__(self, base: torch.nn.Linear, rank: int = 8):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(rank, base.out_features, bias=False)})
        self._active_adapter = "default"


@pytest.mark.parametrize("end", ["first", "last"])
def test_writes_through_data_to_adapter_tensors_are_seen(model, end):
    """PEFT's hotswap_adapter copies through `.data` (no version bump, same storage): the adapter tensors' first and
    last entries are compared by value; rewriting the same values keeps the fingerprint; after `.data = ...` (new
    storage) the new storage is the one read."""
    mlp = model.model.layers[0].mlp
    mlp.down_proj = StandInLora(mlp.down_proj)
    weight = mlp.down_proj.lora_B["default"].weight
    before = weights_fingerprint(model)
    weight.data.copy_(weight.detach().clone())
    assert weights_fingerprint(model) == before  # the same values: K/V still valid
    entry = 0 if end == "first" else -1
    weight.data.view(-1)[entry] += 1.0
    changed = weights_fingerprint(model)
    assert changed != before
    weight.data = weight.data.clone()  # new storage (seen by its address)
    moved = weights_fingerprint(model)
    assert moved != changed and weights_fingerprint(model) == moved
    weight.data.view(-1)[entry] -= 1.0  # into the new storage
    assert weights_fingerprint(model) != moved


def test_the_fingerprint_holds_no_weak_reference_to_a_tensor(model):
    """`torch.utils.swap_tensors` (`model.to(...)` with set_swap_module_params_on_conversion) refuses weakly referenced
    tensors: taking a fingerprint must not make a plain cast of the model fail; the cast changes the fingerprint."""
    import weakref

    before = weights_fingerprint(model)
    assert not any(weakref.getweakrefs(t) for t in (*model.parameters(), *model.buffers()))
    weight = model.model.embed_tokens.weight
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert model.model.embed_tokens.weight is weight and weight.dtype == torch.float64  # swapped in place
    assert weights_fingerprint(model) != before


def test_a_replacement_never_takes_a_freed_tensors_identity(model):
    """A weight replaced and freed: its replacement may get the freed tensor's id and storage, never its fingerprint;
    an unrelated registration keeps the fingerprint."""
    layer = model.model.layers[0].mlp.up_proj
    before = weights_fingerprint(model)
    model.register_buffer("unrelated_marker", None)  # a registration: the model is listed again, same tensors
    assert weights_fingerprint(model) == before
    seen, reused = {}, 0  # (id, address) of each replacement -> the fingerprint with it
    for _ in range(200):
        shape, dtype = layer.weight.shape, layer.weight.dtype
        layer.weight = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))  # the one before last is freed now
        now = weights_fingerprint(model)
        where = (id(layer.weight), layer.weight.data_ptr())
        if where in seen:  # a freed tensor's id and storage taken over: a different fingerprint all the same
            reused += 1
            assert now != seen[where]
        seen[where] = now
    assert reused  # the allocator did hand a freed tensor's id and storage to a new one (else this tested nothing)
