"""model/paged_forward.py: the 'paged' attention function refuses, naming the model, whatever it would otherwise
ignore, and each packed row's position in its own sequence. (Parity of the forward itself is the feature suites'.)"""
import pytest
import torch

from hf_paged.attention import AttentionMetadata
from hf_paged.model.paged_forward import (UnsupportedAttention, check_supported, paged_attention_forward,
                                          sequence_positions)


class Attention(torch.nn.Module):
    config = type("Config", (), {"model_type": "toy"})()


@pytest.mark.parametrize("args, dropout, kwargs, message", [
    ((1,), 0.0, {}, "passes 1 extra positional argument"),
    ((), 0.1, {}, r"attention dropout 0.1 .*model.eval\(\)"),
    ((), 0.0, {"is_causal": False}, "non-causal attention is not supported"),
    ((), 0.0, {"attention_bias": torch.zeros(1)}, r"passes \['attention_bias'\]"),
])
def test_what_the_paged_attention_does_not_implement_is_refused(args, dropout, kwargs, message):
    with pytest.raises(UnsupportedAttention, match="model type 'toy': .*" + message):
        check_supported(Attention(), args, dropout, kwargs)


@pytest.mark.parametrize("args, dropout, kwargs, message", [
    ((1,), 0.0, {}, "passes 1 extra positional argument"),
    ((), 0.1, {}, r"attention dropout 0.1"),
    ((), 0.0, {"is_causal": False}, "non-causal attention is not supported"),
    ((), 0.0, {"attention_bias": torch.zeros(1), "position_ids": None}, r"passes \['attention_bias'\]"),
])
def test_the_paged_function_refuses_before_it_reads_its_context(args, dropout, kwargs, message):
    """The function itself checks a call's extras (not only `check_supported` when asked): nothing is stored first."""
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(UnsupportedAttention, match="model type 'toy': .*" + message):
        paged_attention_forward(Attention(), q, q, q, None, *args, dropout=dropout, paged_context=object(), **kwargs)


def test_transformers_builds_no_mask_for_a_paged_forward(llama, monkeypatch, one_torch_thread):
    """The paged attention registers no mask function, so transformers' mask builders return at once (they would
    otherwise look for packed sequences in the step's position ids every step, only to build no mask)."""
    from transformers import masking_utils

    exits = []
    original = masking_utils._preprocess_mask_arguments

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        config = args[0] if args else kwargs["config"]
        if config._attn_implementation == "paged":  # not the start-up check's reference forwards
            exits.append(out[0])
        return out

    monkeypatch.setattr(masking_utils, "_preprocess_mask_arguments", spy)
    ids = torch.randint(3, 200, (2, 6))
    llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                   cache_implementation="paged")
    assert exits and all(exits), exits


def test_flags_it_honours_and_empty_values_pass():
    check_supported(Attention(), (), 0.0, {"position_ids": torch.zeros(1), "use_cache": True, "sinks": None,
                                           "output_attentions": False, "is_causal": True})


def test_the_paged_function_outside_the_engine_says_so():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(UnsupportedAttention, match="runs only inside hf_paged's engine.*'toy'"):
        paged_attention_forward(Attention(), q, q, q, None)


def test_sequence_positions_count_from_each_sequences_cached_context():
    # a decode at position 6, a fresh 3-token prompt, a 2-token chunk after 4 cached tokens
    tables = [[1, 2], [3], [4, 5]]
    meta = AttentionMetadata.build([1, 3, 2], [7, 3, 6], tables, list(range(6)), 4, torch.device("cpu"))
    assert sequence_positions(meta).tolist() == [6, 0, 1, 2, 4, 5]


def test_what_a_layer_needs_is_found_once_per_engine(llama, monkeypatch, one_torch_thread):
    """Each attention module's layer, attention chunk and query temperature are read on its first call and kept for
    the engine's later steps (`LayerCall`); a module swapped in later gets its own reading."""
    import copy

    from hf_paged import LLM, SamplingParams
    from hf_paged.model import paged_forward

    found = []
    original = paged_forward._chunk_size
    monkeypatch.setattr(paged_forward, "_chunk_size", lambda module, layer: found.append(layer) or original(module, layer))
    llm = LLM(llama)
    found.clear()  # the start-up check's forwards each have a context of their own
    params = SamplingParams(max_tokens=6, temperature=0.0)
    first = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    layers = llama.config.num_hidden_layers
    assert sorted(found) == list(range(layers))  # 6 steps, one reading per layer
    attention = llama.model.layers[0].self_attn
    swapped = copy.deepcopy(attention)
    swapped.config = attention.config  # the model's config: the engine switches its attention for the step
    llama.model.layers[0].self_attn = swapped
    try:
        again = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llama.model.layers[0].self_attn = attention
    assert sorted(found) == sorted([*range(layers), 0]) and again == first


def test_a_layer_whose_attention_leaves_the_paged_cache_fails_the_step(llama, one_torch_thread):
    """A module swapped in with a config of its own reads transformers' own attention, which would attend over the
    step's tokens alone: the engine counts the attention calls of every forward and undoes such a step (an error,
    never tokens computed without the cache)."""
    import copy

    from hf_paged import LLM, SamplingParams

    llm = LLM(llama)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    attention = llama.model.layers[0].self_attn
    llama.model.layers[0].self_attn = copy.deepcopy(attention)  # its config is a copy too
    try:
        with pytest.raises(RuntimeError, match="1 attention calls reached the paged KV cache"):
            llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    finally:
        llama.model.layers[0].self_attn = attention
    assert llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.engine.stats()["num_blocks_free"] == llm.engine.stats()["num_blocks_total"]
