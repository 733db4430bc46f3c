"""Never silently wrong: attention arguments the paged function does not implement are refused, and an engine
checks at start that its paged forward reproduces the model's own logits."""
import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.tiny import tiny_model


def tiny_gpt_oss():
    import transformers as tf

    config = tf.GptOssConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=256, sliding_window=8)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def test_gpt_oss_attention_sinks_are_served_exactly():
    """gpt-oss adds a learnable per-head sink logit to every softmax (`s_aux`): ignoring it gave wrong tokens."""
    model = tiny_gpt_oss()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 0, 0, 0, 3, 4, 5, 6, 7, 8]])
    mask = (ids != 0).long()
    options = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **options)
    assert torch.equal(model.generate(ids, cache_implementation="paged", **options), want)


def test_attention_arguments_it_does_not_implement_are_refused_at_start():
    """Any argument a module passes that the paged function does not implement (here an attention bias slipped
    into one layer) refuses the model when the engine starts, naming the model type and the argument."""
    model = tiny_model("llama")
    attention = model.model.layers[1].self_attn
    original = attention.forward
    attention.forward = lambda *args, **kwargs: original(*args, **kwargs, alibi_bias=torch.ones(1))
    try:
        with pytest.raises(ValueError, match=r"'llama'.*\['alibi_bias'\]"):
            LLM(model)
    finally:
        del attention.forward


def test_a_model_whose_attention_differs_is_refused():
    """A model whose own attention implementation adds a bias the interface never sees (as a custom attention
    function can): the paged forward cannot reproduce it, and the start-up check says so."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def biased(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out + 0.5, weights

    AttentionInterface.register("test_biased", biased)
    try:
        model = tiny_model("llama", attn_implementation="test_biased")
        with pytest.raises(ValueError, match="does not reproduce the model's own attention"):
            LLM(model)
        model.set_attn_implementation("sdpa")
        model.__dict__.pop("_hf_paged_probe", None)
        LLM(model).generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # its own attention: served
    finally:
        AttentionInterface._global_mapping.pop("test_biased", None)


def test_the_start_up_check_is_cheap_and_done_once_per_model():
    model = tiny_model("llama")
    LLM(model)
    ((key, verdict),) = model._hf_paged_probe.items()  # one passing verdict, per backend / dtype / device / window
    assert key[:3] == ("auto", "torch.float32", "cpu") and verdict is None
    calls = []
    original = model.forward
    model.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        LLM(model)
    finally:
        del model.forward
    assert calls == []  # the verdict is kept on the model


def _tiny(name):
    import transformers as tf

    configs = {
        "biogpt": lambda: tf.BioGptConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, max_position_embeddings=256),
        "gpt_bigcode": lambda: tf.GPTBigCodeConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256),
        "stablelm": lambda: tf.StableLmConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                              max_position_embeddings=256),
        "openai-gpt": lambda: tf.OpenAIGPTConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256),
        "bloom": lambda: tf.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4),
    }
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(configs[name]()).eval()


@pytest.mark.parametrize("name", ["biogpt", "gpt_bigcode", "bloom", "stablelm"])
def test_models_without_the_class_flag_are_served_when_they_behave(name):
    """Servability is decided by what the model does, not by `_supports_attention_backend`: gpt_bigcode's K/V
    shape (multi-query) is read from its modules, bloom's attention modules compute ALiBi attention themselves,
    stablelm's decoder layers drop the forward's keywords."""
    model = _tiny(name)
    prompt = [5, 6, 7, 8, 9]
    got = LLM(model).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)[0].token_ids
    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                          do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert got == want


@pytest.mark.parametrize("name, reason", [
    ("openai-gpt", "0 of its 2 layers route attention"),  # computes attention itself, with no adapter here
])
def test_models_that_cannot_be_paged_get_a_clear_value_error(name, reason):
    with pytest.raises(ValueError, match=reason):
        LLM(_tiny(name))


def test_a_passing_failure_during_the_check_is_not_kept():
    model = tiny_model("llama")
    layer = model.model.layers[-1]
    calls = []

    def flaky(*args, **kwargs):
        if kwargs.get("paged_context") is not None:  # the start-up check's paged forward
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("transient")
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = flaky
    try:
        with pytest.raises(ValueError, match="transient"):
            LLM(model)
        LLM(model).generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # checked again: served
    finally:
        del layer.forward


def test_a_refusal_in_training_mode_is_not_kept_for_eval_mode():
    """A model with attention dropout is refused in training mode (no two forwards agree), rightly; after
    `model.eval()` it is served (the verdict used to be kept without the mode)."""
    from hf_paged import LLM, SamplingParams
    from hf_paged.tiny import tiny_model

    model = tiny_model("llama", attention_dropout=0.5).train()
    with pytest.raises(ValueError, match="training mode"):
        LLM(model, attention_backend="torch")
    model.eval()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = LLM(model, attention_backend="torch").generate([[5, 6, 7]], params, use_tqdm=False)[0]
    ids = torch.tensor([[5, 6, 7]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert out.token_ids == want
