"""Several states in one layer (`state_modules.find_state_modules`): each state (layer, state index) of transformers'
cache calls is used by its own module, which the engine runs on its own; two modules on one state, or a state module
inside another, are refused.

The model is inkling's: four short convolutions per layer, each keeping conv state `conv_idx` of its layer, two of them
inside its attention module."""
import pytest
import torch

import hf_paged
from hf_paged.model.state_modules import find_state_modules
from hf_paged.tiny import tiny_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONVOLUTIONS = ("self_attn.k_sconv", "self_attn.v_sconv", "attn_sconv", "mlp_sconv")  # conv states 0, 1, 2, 3


def test_each_state_of_a_layer_is_kept_apart():
    """Every convolution is a state module of its layer, inside the attention module too; after a run the engine's
    slots held one conv state per (layer, state index), each of the module's own width."""
    model = tiny_hybrid("inkling_text")
    layers = range(model.config.num_hidden_layers)
    assert find_state_modules(model) == {f"model.layers.{i}.{name}": i for i in layers for name in CONVOLUTIONS}
    llm = hf_paged.LLM(model, num_blocks=32, block_size=4)
    llm.generate([[5, 6, 7, 8, 9]], hf_paged.SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    tensors = llm.engine.scheduler.kv.states.tensors
    assert set(tensors) == {(i, "conv", index) for i in layers for index in range(len(CONVOLUTIONS))}
    for i in layers:
        block = model.model.layers[i]
        widths = [block.get_submodule(name).conv1d.in_channels for name in CONVOLUTIONS]
        assert [tensors[(i, "conv", index)].shape[1] for index in range(len(CONVOLUTIONS))] == widths


def test_two_modules_on_one_state_are_refused():
    """Layer 1's MLP convolution made to keep conv state 2, the attention output's: each would run on its own and
    overwrite the other's state, so the model is refused, naming both."""
    model = tiny_hybrid("inkling_text")
    model.model.layers[1].mlp_sconv.conv_idx = 2
    with pytest.raises(ValueError, match=r"several modules use one state of a layer: \{'layer 1 state 2': "
                                         r"\['model.layers.1.attn_sconv', 'model.layers.1.mlp_sconv'\]\}"):
        hf_paged.LLM(model)


def test_a_state_module_inside_another_is_refused():
    """An attention module that asks the cache about its layer's state itself holds the convolutions that keep it:
    running it per group of sequences would hand its inner modules a batch they cannot split; refused."""
    model = tiny_hybrid("inkling_text")
    attention = model.model.layers[0].self_attn
    own = attention.forward

    def asking(*args, cache=None, **kwargs):
        if cache is not None:
            cache.has_previous_state(attention.layer_idx)
        return own(*args, cache=cache, **kwargs)

    attention.forward = asking
    with pytest.raises(ValueError, match=r"state module 'model.layers.0.self_attn.k_sconv' runs inside state "
                                         r"module 'model.layers.0.self_attn'"):
        hf_paged.LLM(model)
