"""`PagedCache` on hybrid models (linear-attention / state-space layers beside attention, or both in one layer):
HF's own generate loop on a passed PagedCache gives exactly what it gives on its `DynamicCache` (fp32, token for
token, logits to 1e-5) greedy on a left-padded batch, in beam search (states reordered), sampling, continuing a
returned cache, assisted decoding (states rolled back by `crop`); its layers answer HF's questions as DynamicCache's
do; rows move together in selections; what it cannot hold or undo is refused.

The tiny models are built from their real config classes with 4 layers whose pattern (the config's own) holds each
of the model's layer types, and an output head sharpened (x8) so greedy choices have clear margins.
"""
from __future__ import annotations

import functools

import pytest
import torch
import transformers as tf
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

from conftest import left_padded_batch
from hf_paged import PagedCache
from hf_paged.integrations.paged_cache import PagedHybridLayer, PagedLayer, StateLayer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8, mamba_n_groups=1)
GATED_DELTA = dict(head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=8)
NO_LAYER_COUNT = {k: v for k, v in COMMON.items() if k != "num_hidden_layers"}  # nemotron_h counts its pattern

CONFIGS = {  # model type -> its config; the comment is the layer pattern (cache layer types)
    # linear_attention x3, full_attention
    "qwen3_5_text": lambda: tf.Qwen3_5TextConfig(**COMMON, **GATED_DELTA),
    "qwen3_next": lambda: tf.Qwen3NextConfig(**COMMON, **GATED_DELTA, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, shared_expert_intermediate_size=32),
    # linear_attention only: no pages at all
    "mamba2": lambda: tf.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_heads=4, head_dim=16,
                                      state_size=8, n_groups=1, chunk_size=8, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0),
    # M * M - : linear_attention, full_attention, linear_attention, dummy (an MLP layer)
    "nemotron_h": lambda: tf.NemotronHConfig(**NO_LAYER_COUNT, hybrid_override_pattern="M*M-", head_dim=8,
                                             mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                                             chunk_size=8),
    # hybrid x4: attention and mamba in every layer
    "falcon_h1": lambda: tf.FalconH1Config(**COMMON, head_dim=8, mamba_d_ssm=64, **MAMBA),
    "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(
        **COMMON, layer_types=["linear_attention"] * 3 + ["full_attention"], num_local_experts=4,
        shared_intermediate_size=32, **MAMBA),
    # linear_attention, full_attention, linear_attention, full_attention
    "bamba": lambda: tf.BambaConfig(**COMMON, attn_layer_indices=[1, 3], **MAMBA),
    # linear_attention x2, full_attention, linear_attention (MoE every 2nd layer)
    "jamba": lambda: tf.JambaConfig(**COMMON, attn_layer_period=4, attn_layer_offset=2, num_experts=4,
                                    mamba_d_state=8),
    # conv, full_attention, conv, full_attention
    "lfm2": lambda: tf.Lfm2Config(**COMMON, full_attn_idxs=[1, 3]),
    # linear_attention, hybrid (the shared transformer block and a mamba layer), x2
    # hybrid_sliding x3 (window 4), hybrid; 4 conv states per layer
    "inkling_text": lambda: tf.AutoConfig.for_model(
        "inkling_text", **COMMON, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=4, d_rel=4, rel_extent=16, local_layer_ids=[0, 1, 2], moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    # conv and full attention, attention first (a crop refused midway would already have cut layer 0)
    "lfm2_attention_first": lambda: tf.Lfm2Config(**COMMON, full_attn_idxs=[0, 2]),
    "zamba2": lambda: tf.Zamba2Config(**COMMON, layers_block_type=["linear_attention", "hybrid"] * 2,
                                      n_mamba_heads=4, mamba_d_state=8, chunk_size=8),
}
MODELS = [name for name in CONFIGS if name != "lfm2_attention_first"]
OURS = {"DynamicLayer": PagedLayer, "DynamicSlidingWindowLayer": PagedLayer, "LinearAttentionLayer": StateLayer,
        "LinearAttentionAndFullAttentionLayer": PagedHybridLayer, "DummyLayer": DummyLayer,
        "LinearAttentionAndSlidingWindowAttentionLayer": PagedHybridLayer}  # DynamicCache's layer -> ours
SPREAD = ["qwen3_5_text", "falcon_h1", "nemotron_h", "mamba2"]  # state+attention, hybrid, dummy, states only


@functools.lru_cache(maxsize=None)
def model(name: str, seed: int = 0):
    config = CONFIGS[name]()
    torch.manual_seed(seed)
    built = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        built.get_output_embeddings().weight.mul_(8.0)
    built.generation_config.pad_token_id, built.generation_config.eos_token_id = 0, 2
    return built


def batch():
    return left_padded_batch([9, 4, 6], vocab=VOCAB, seed=5)


def generate(m, ids, mask, cache=None, seed=0, new=8, **kwargs):
    torch.manual_seed(seed)
    extra = {} if cache is None else {"cache": cache}
    return m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, return_dict_in_generate=True,
                      output_logits=True, **extra, **kwargs)


def assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences), f"\npaged {out.sequences.tolist()}\nHF {ref.sequences.tolist()}"
    assert len(out.logits) == len(ref.logits)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # the same math (a state off by a token: ~1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_layers_answer_as_dynamic_cache_does(name):
    """After the same prefill: one PagedCache layer per DynamicCache layer of the same kind (states in transformers'
    own linear layer, attention in pages, both in a hybrid layer), equal states, lengths, mask sizes and flags."""
    m = model(name)
    ids, mask = batch()
    paged, dynamic = PagedCache(m.config), DynamicCache(config=m.config)
    with torch.no_grad():
        for cache in (paged, dynamic):
            m(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    assert len(paged.layers) == len(dynamic.layers)
    for index, (ours, theirs) in enumerate(zip(paged.layers, dynamic.layers)):
        kind = type(theirs).__name__
        assert type(ours) is OURS[kind], (index, kind)
        if kind == "DummyLayer":  # holds nothing, answers nothing (HF's: it has no length)
            continue
        ours_length, their_length = paged.get_seq_length(index), dynamic.get_seq_length(index)
        assert type(ours_length) is type(their_length) and int(ours_length) == int(their_length), (index, kind)
        if isinstance(ours, LinearAttentionCacheLayerMixin):
            assert paged.has_previous_state(index) and dynamic.has_previous_state(index)
            for state in range(ours.number_of_states):
                for get in ("get_conv_state", "get_recurrent_state"):
                    a, b = getattr(paged, get)(index, state), getattr(dynamic, get)(index, state)
                    assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (index, get)
        if isinstance(ours, PagedLayer) and not ours.is_sliding:
            assert paged.get_mask_sizes(1, index) == dynamic.get_mask_sizes(1, index)
            torch.testing.assert_close(ours.keys, theirs.keys, rtol=0, atol=0)
        elif isinstance(ours, PagedLayer):  # a window: HF keeps its last positions, the pages every position (the
            assert paged.get_mask_sizes(1, index) == (ours.length + 1, 0)  # mask applies the window)
            torch.testing.assert_close(ours.keys[:, :, -theirs.keys.shape[2]:], theirs.keys, rtol=0, atol=0)
    for flag in ("is_linear", "is_sliding", "is_dummy", "is_croppable", "is_compileable"):
        assert getattr(paged, flag) == getattr(dynamic, flag), flag
    assert paged.has_previous_state() == dynamic.has_previous_state()
    assert int(paged.get_seq_length()) == int(dynamic.get_seq_length())
    first = next((layer for layer in paged.layers if isinstance(layer, PagedLayer)), None)
    if first is not None and not first.is_sliding:  # a state layer 0 answers for the first attention layer
        assert paged.get_mask_sizes(3, 0) == dynamic.get_mask_sizes(3, 0) == (first.length + 3, 0)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_left_padded(name):
    m = model(name)
    ids, mask = batch()
    cache = PagedCache(m.config, block_size=2)  # small blocks: sliding windows give some back
    assert_same(generate(m, ids, mask, cache), generate(m, ids, mask))
    assert int(cache.get_seq_length()) > 0  # the model wrote the cache it was given


@pytest.mark.parametrize("name", MODELS)
def test_beam_search_reorders_states(name):
    m = model(name)
    ids, mask = batch()
    kwargs = dict(num_beams=3, num_return_sequences=2, do_sample=False, output_scores=True)
    out, ref = generate(m, ids, mask, PagedCache(m.config, block_size=2), **kwargs), generate(m, ids, mask, **kwargs)
    assert_same(out, ref)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_sampling_with_a_seed(name):
    m = model(name)
    ids, mask = batch()
    kwargs = dict(do_sample=True, top_k=8, temperature=1.5)
    out = generate(m, ids, mask, PagedCache(m.config), seed=3, **kwargs)
    assert_same(out, generate(m, ids, mask, seed=3, **kwargs))


@pytest.mark.parametrize("name", MODELS)
def test_continuing_a_returned_cache(name):
    """`generate(out.sequences, cache=out.cache)` continues (states and pages) as DynamicCache's does, and equals
    one uninterrupted call."""
    m = model(name)
    ids, mask = batch()

    def two_calls(cache):
        first = generate(m, ids, mask, cache, new=4)
        assert first.cache is cache
        grown = torch.cat([mask, mask.new_ones(mask.shape[0], first.sequences.shape[1] - ids.shape[1])], dim=1)
        return generate(m, first.sequences, grown, first.cache, new=5)

    out, ref = two_calls(PagedCache(m.config)), two_calls(DynamicCache(config=m.config))
    assert_same(out, ref)
    assert torch.equal(out.sequences, generate(m, ids, mask, new=9).sequences)


@pytest.mark.parametrize("name", SPREAD)
def test_reset_cache_generates_as_new(name):
    """`reset()` empties pages and states alike: the cache then generates as a new one."""
    m = model(name)
    ids, mask = batch()
    cache = PagedCache(m.config)
    generate(m, ids[:, 3:], mask[:, 3:], cache, new=3)
    cache.reset()
    assert int(cache.get_seq_length()) == 0
    assert_same(generate(m, ids, mask, cache), generate(m, ids, mask))


@pytest.mark.parametrize("name", MODELS)
def test_assisted_decoding_rolls_states_back(name):
    """An assistant of other weights is mostly rejected: each step crops the cache, which rolls the states back to
    the recorded ones; the result is plain greedy's, as on a DynamicCache."""
    m, assistant = model(name), model(name, seed=1)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    kwargs = dict(assistant_model=assistant, do_sample=False)
    out = generate(m, ids, mask, PagedCache(m.config), new=10, **kwargs)
    ref = generate(m, ids, mask, DynamicCache(config=m.config), new=10, **kwargs)
    assert_same(out, ref)
    assert torch.equal(out.sequences, generate(m, ids, mask, new=10).sequences)


@pytest.mark.parametrize("name", SPREAD)
@pytest.mark.parametrize("how", ["select", "repeat"])
def test_row_selection_moves_states_and_pages_together(name, how):
    """`batch_select_indices` / `batch_repeat_interleave` after a prefill, then two decode steps: the logits of a
    DynamicCache prefilled with the selected rows (HF's linear layers have no row selection to compare with)."""
    m = model(name)
    ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    rows = [2, 0] if how == "select" else [0, 0, 1, 1, 2, 2]
    paged, dynamic = PagedCache(m.config), DynamicCache(config=m.config)
    with torch.no_grad():
        m(input_ids=ids, cache=paged, use_cache=True)
        paged.batch_select_indices(torch.tensor(rows)) if how == "select" else paged.batch_repeat_interleave(2)
        m(input_ids=ids[rows], cache=dynamic, use_cache=True)
        for token in (5, 7):
            step = torch.full((len(rows), 1), token)
            got = m(input_ids=step, cache=paged, use_cache=True).logits
            torch.testing.assert_close(got, m(input_ids=step, cache=dynamic, use_cache=True).logits,
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", SPREAD + ["lfm2_attention_first"])
def test_crop_without_recorded_states_is_refused_unchanged(name):
    """States cannot be rolled back unless recorded (transformers' rule, DynamicCache raises too): the PagedCache
    raises before changing any layer, and decoding on goes exactly as without the attempt."""
    m = model(name)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    paged, dynamic = PagedCache(m.config), DynamicCache(config=m.config)
    with torch.no_grad():
        m(input_ids=ids, cache=paged, use_cache=True)
        m(input_ids=ids, cache=dynamic, use_cache=True)
        with pytest.raises(RuntimeError):
            dynamic.crop(-1)
        length = int(paged.get_seq_length())
        with pytest.raises(RuntimeError, match="activate_past_recording"):
            paged.crop(-1)
        assert int(paged.get_seq_length()) == length
        fresh = DynamicCache(config=m.config)
        m(input_ids=ids, cache=fresh, use_cache=True)
        step = torch.full((2, 1), 9)
        torch.testing.assert_close(m(input_ids=step, cache=paged, use_cache=True).logits,
                                   m(input_ids=step, cache=fresh, use_cache=True).logits, rtol=1e-5, atol=1e-5)


def test_layer_kinds_and_refusals():
    """Every layer type transformers dispatches: hybrid sliding layers get their window's store; types PagedCache
    cannot hold are refused when it is built (ValueError: the census reports "refused")."""
    config = tf.Qwen2Config(**COMMON, sliding_window=4, use_sliding_window=True,
                            layer_types=["hybrid_sliding", "hybrid", "conv", "sliding_attention"])
    paged, dynamic = PagedCache(config), DynamicCache(config=config)
    assert [type(layer) for layer in paged.layers] == [PagedHybridLayer, PagedHybridLayer, StateLayer, PagedLayer]
    assert paged.is_sliding == dynamic.is_sliding == [True, False, False, True]
    assert paged.is_linear == dynamic.is_linear == [False, False, True, False]
    assert paged.layers[0].store is paged.layers[3].store is not paged.layers[1].store
    config.layer_types = ["linear_attention", "indexed_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match="indexed_attention"):
        PagedCache(config)


def test_kv_cache_memory_counts_attention_layers_only():
    """The budget sizes the pages of the layers that keep K/V; a model without attention needs none."""
    budget = 2 * 16 * 2 * 8 * 4 * 10  # 10 blocks of the one attention layer (2 KV heads x 8, fp32)
    assert PagedCache(model("qwen3_5_text").config, kv_cache_memory=budget).store.pool.num_blocks == 10
    m = model("mamba2")
    ids, mask = batch()
    assert_same(generate(m, ids, mask, PagedCache(m.config, kv_cache_memory=1)), generate(m, ids, mask))
