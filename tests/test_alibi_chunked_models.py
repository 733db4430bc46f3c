"""ALiBi (bloom, mpt: their attention modules compute attention themselves, as gpt_neo's do) and chunked local
attention (llama4's chunked_attention layers) served exactly: greedy parity with HF fp32 on tiny random-weight models, left-padded
batches long enough to cross several pages and attention chunks."""
import pytest
import torch
from conftest import assert_same_as_hf

from hf_paged import LLM, SamplingParams


def _sharpened(config, seed=0):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    return model


def tiny(name, **overrides):
    import transformers as tf

    if name == "bloom":
        config = tf.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, **overrides)
    elif name == "gpt_neo":  # computes attention itself too: unscaled, local layers with a window of 4
        config = tf.GPTNeoConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, window_size=4,
                                 attention_types=[[["global", "local"], 1]], max_position_embeddings=256, **overrides)
    elif name == "mpt":
        config = tf.MptConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=128, expansion_ratio=2,
                              attn_config={"alibi_bias_max": 6, "clip_qkv": 0.9}, **overrides)
    else:  # llama4 text: chunked attention layers of 4 tokens (with NoPE) between full attention layers
        options = dict(vocab_size=256, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_local_experts=2, layer_types=["chunked_attention", "full_attention"] * 2,
                       no_rope_layers=[1, 0, 1, 0], attention_chunk_size=4, max_position_embeddings=256)
        config = tf.Llama4TextConfig(**{**options, **overrides})
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(config, key, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key])
    return _sharpened(config)


def batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.zeros(3, 13, dtype=torch.long)
    for row, length in enumerate((13, 6, 9)):
        ids[row, 13 - length:] = torch.randint(3, 256, (length,), generator=gen)
    return ids, (ids != 0).long()


@pytest.mark.parametrize("name", ["bloom", "mpt", "llama4_text", "gpt_neo"])
def test_greedy_parity_with_hf(name, one_torch_thread):
    ids, mask = batch()
    assert_same_as_hf(tiny(name), ids, mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)


def test_llama4_chunks_really_limit_attention(one_torch_thread):
    """The same weights with one chunk covering everything give other tokens: the chunks are in force."""
    ids, mask = batch()
    options = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                   cache_implementation="paged")
    chunked = tiny("llama4_text").generate(ids, **options)
    assert not torch.equal(chunked, tiny("llama4_text", attention_chunk_size=64).generate(ids, **options))


def test_llama4_query_temperature_uses_true_positions(one_torch_thread):
    """llama4's NoPE layers scale queries by a function of the position (floor_scale 4 here, 8192 in the real
    models): with packed rows the position is each token's own, in prefill and decode."""
    model = tiny("llama4_text", floor_scale=4, attn_scale=0.5)
    prompt = [5, 9, 17, 33, 65, 129, 7, 11, 200, 3]
    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(model)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate([prompt, prompt[:4], prompt], params, use_tqdm=False)  # packed with others
    assert outs[0].token_ids == want and outs[2].token_ids == want
