"""Which decoder layers run transformers' Llama layer code (hf_paged/model/layer_code.py), what their rotary call
resolves to, and when a direct `forward` call is what `module(...)` would do."""
import torch

from hf_paged.model import layer_code
from hf_paged.tiny import tiny_model


def test_llama_layers_are_found_and_other_layer_code_is_not():
    llama = tiny_model("llama")
    for layer in llama.model.layers:
        attention, mlp, norm1, norm2, rotary, code, qk = layer_code.llama_parts(layer)
        assert attention is layer.self_attn and mlp is layer.mlp and norm1 is layer.input_layernorm
        assert norm2 is layer.post_attention_layernorm and rotary is layer_code.rotary_call(attention)
        assert code == "LlamaAttention" and qk == ()
    for arch, code in (("mistral", "MistralAttention"), ("qwen2", "Qwen2Attention"), ("qwen3", "Qwen3Attention")):
        for layer in tiny_model(arch).model.layers:
            parts = layer_code.llama_parts(layer)
            assert parts[5] == code and parts[6] == (() if arch != "qwen3" else
                                                     (layer.self_attn.q_norm, layer.self_attn.k_norm))
    for arch in ("phi3", "gemma2"):  # attention or layer code not mirrored
        assert all(layer_code.llama_parts(layer) is None for layer in tiny_model(arch).model.layers)
    assert layer_code.llama_parts(llama.model.layers[0].mlp) is None  # not a decoder layer


def test_causal_lm_code_but_for_its_docstring():
    """Mistral's causal-LM forward is Llama's but for the docstring's example; gpt2's is another code."""
    mistral, gpt2 = type(tiny_model("mistral")), type(tiny_model("gpt2"))
    assert not layer_code.code_is(mistral, "LlamaForCausalLM")
    assert layer_code.code_is(mistral, "LlamaForCausalLM", docstring=False)
    assert not layer_code.code_is(gpt2, "LlamaForCausalLM", docstring=False)


def test_another_transformers_source_of_the_llama_code_turns_it_off(monkeypatch):
    layer = tiny_model("llama").model.layers[0]
    monkeypatch.setitem(layer_code.KNOWN_SOURCES, "LlamaAttention", "0" * 16)
    layer_code.references.cache_clear()
    try:
        assert layer_code.references() is None and layer_code.llama_parts(layer) is None
    finally:
        monkeypatch.undo()
        layer_code.references.cache_clear()
    assert layer_code.llama_parts(layer) is not None


def test_the_rotary_call_is_the_attentions_own_wrapper_or_a_patched_global(monkeypatch):
    attention = tiny_model("llama").model.layers[0].self_attn
    wrapper = layer_code.rotary_call(attention)
    assert isinstance(wrapper, torch.nn.Module) and wrapper in vars(attention)["_kernel_funcs"].values()
    module = __import__(type(attention).__module__, fromlist=["_"])

    def plain(q, k, cos, sin, unsqueeze_dim=1):
        return q, k
    monkeypatch.setattr(module, layer_code.ROTARY, plain)
    assert layer_code.rotary_call(attention) is plain
    monkeypatch.setattr(module, layer_code.ROTARY, object())  # neither a kernels function nor a plain one
    assert layer_code.rotary_call(attention) is None


def test_plain_calls_sees_every_hook_and_a_compiled_call():
    linear, function = torch.nn.Linear(4, 4), lambda x: x
    assert layer_code.plain_calls([linear, function])
    for register in (linear.register_forward_hook, linear.register_forward_pre_hook,
                     linear.register_full_backward_hook, linear.register_full_backward_pre_hook):
        handle = register(lambda *args: None)
        assert not layer_code.plain_calls([linear, function])
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert not layer_code.plain_calls([linear])
    finally:
        handle.remove()
    linear._compiled_call_impl = lambda *args: None
    assert not layer_code.plain_calls([linear])
    linear._compiled_call_impl = None
    assert layer_code.plain_calls([linear])
    assert layer_code.call(linear, torch.ones(1, 4)).shape == (1, 4) and layer_code.call(function, 3) == 3
