"""tiny.py: the random-weight test models and the character tokenizer, built in code (no download): the same seed
gives the same weights, the sizes asked for, eval mode, and a tokenizer whose text round-trips."""
import torch

from hf_paged.tiny import SPECIAL_TOKENS, tiny_config, tiny_model, tiny_tokenizer, tiny_vocab


def test_the_same_seed_gives_the_same_model_in_eval_mode():
    a, b, c = tiny_model("llama", seed=1), tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    assert not a.training
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_configs_have_the_sizes_asked_for():
    config = tiny_config("mistral", vocab_size=100, hidden=32, layers=3, heads=2)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        100, 32, 3, 2)


def test_the_character_tokenizer_round_trips_text():
    vocab = tiny_vocab()
    assert [vocab[t] for t in SPECIAL_TOKENS] == [0, 1, 2, 3] and len(vocab) == 128
    tokenizer = tiny_tokenizer()
    ids = tokenizer("hi there\n", add_special_tokens=False)["input_ids"]
    assert len(ids) == 9 and tokenizer.decode(ids) == "hi there\n"


def test_the_transformers_helpers_the_benchmarks_use():
    """tiny.py is where the benchmarks and the census reach transformers (the package keeps that import at its edge)."""
    from hf_paged import tiny

    assert "llama" in tiny.causal_lm_types() and tiny.causal_lm_types() == sorted(tiny.causal_lm_types())
    config = tiny.config_of("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                            intermediate_size=64)
    assert type(config).__name__ == "LlamaConfig" and config.hidden_size == 32
    model = tiny.model_from_config(config)
    assert not model.training and type(model).__name__ == "LlamaForCausalLM"
    assert tiny.dynamic_cache(config=config).get_seq_length() == 0
    assert tiny.transformers_version().split(".")[0].isdigit()
