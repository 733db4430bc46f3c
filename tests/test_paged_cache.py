"""`PagedCache`: HF's own generate loop and plain forward loops on paged memory give exactly what `DynamicCache`
gives (fp32, token for token; scores to float tolerance), beams share blocks, crop frees blocks, and calls the
engine cannot run go to HF's loop on a PagedCache (never to DynamicCache). Every mode on five architectures:
test_paged_cache_modes.py."""
from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import DynamicCache

from hf_paged import PagedCache
from takeover_helpers import batch, model_for, on_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=8),
    "beam": dict(num_beams=3, do_sample=False, num_return_sequences=2),
    "beam_sample": dict(num_beams=2, do_sample=True, top_k=8),
}


def run(model, ids, mask, cache=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    extra = {} if cache is None else {"cache": cache}
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                          return_dict_in_generate=True, output_scores=True, output_logits=True, **extra, **kwargs)


def assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("side", ["left", "right", "none"])
@pytest.mark.parametrize("mode", list(MODES))
def test_modes_and_paddings_through_the_take_over(mode, side, caplog):
    """`cache_implementation="paged"` in every mode and padding equals HF (scores and logits too), on the engine
    or in HF's loop on a PagedCache; never on DynamicCache; the returned cache is a PagedCache."""
    model = model_for()
    ids, mask = batch((4, 9, 6) if side != "none" else (9, 9, 9), seed=11, side="left" if side == "none" else side)
    ref = run(model, ids, mask, **MODES[mode])
    with caplog.at_level(logging.DEBUG, logger="hf_paged"):
        out = run(model, ids, mask, cache_implementation="paged", **MODES[mode])
    assert_same(out, ref)
    assert isinstance(out.cache, PagedCache)
    paths = [r.getMessage() for r in caplog.records if r.name == "hf_paged" and "generate" in r.getMessage()]
    assert paths and all("on the paged engine" in p or "on a PagedCache" in p for p in paths), paths


@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_paddings_through_the_take_over(side, engine_runs):
    """Left, right and no padding all run on the engine and equal HF."""
    model = model_for()
    ids, mask = batch((4, 9, 6) if side != "none" else (9, 9, 9), seed=3, side="left" if side == "none" else side)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    with on_engine(engine_runs, model, expected=1):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             cache_implementation="paged")
    assert torch.equal(out, ref)


def test_gaps_in_the_mask_run_on_the_engine(engine_runs):
    """Padding between real tokens: HF numbers positions over real tokens, and so does the engine."""
    model = model_for()
    ids, mask = batch((6, 12), seed=4)
    mask[1, 3:6] = 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    with on_engine(engine_runs, model, expected=1):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="paged")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("where", ["gap", "right"])
def test_padding_inside_a_sliding_window_goes_to_paged_cache(where, engine_runs, caplog):
    """HF's window counts the padding columns inside it, the engine's does not: such calls run in HF's loop."""
    model = model_for("gemma2")
    ids, mask = batch((6, 13), seed=4, side="left" if where == "gap" else "right")
    if where == "gap":
        mask[1, 2:5] = 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        with on_engine(engine_runs, model, expected=0):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                 cache_implementation="paged")
    assert torch.equal(out, ref)
    assert any("sliding-window" in r.getMessage() for r in caplog.records if r.name == "hf_paged")


def test_hidden_states_and_attentions_equal_dynamic_cache():
    model = model_for("llama")
    model.set_attn_implementation("eager")
    try:
        ids, mask = batch((5, 9), seed=6)
        kwargs = dict(output_attentions=True, output_hidden_states=True, do_sample=False)
        out = run(model, ids, mask, PagedCache(model.config, block_size=4), **kwargs)
        ref = run(model, ids, mask, **kwargs)
    finally:
        model.set_attn_implementation("sdpa")
    assert_same(out, ref)
    for step_out, step_ref in zip(out.attentions, ref.attentions):
        for a, b in zip(step_out, step_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for step_out, step_ref in zip(out.hidden_states, ref.hidden_states):
        for a, b in zip(step_out, step_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_plain_forward_loop_equals_dynamic_cache():
    model = model_for("mistral")
    ids = batch((20,), seed=8)[0]
    paged, dynamic = PagedCache(model.config, block_size=4), DynamicCache(config=model.config)
    for cache_ in (paged, dynamic):
        cache_.logits = []
        with torch.no_grad():
            out = model(ids[:, :12], cache=cache_, use_cache=True)
            cache_.logits.append(out.logits)
            for t in range(12, 20):
                cache_.logits.append(model(ids[:, t:t + 1], cache=cache_, use_cache=True).logits)
    for a, b in zip(paged.logits, dynamic.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert paged.get_seq_length() == dynamic.get_seq_length() == 20
    assert paged.get_mask_sizes(1, 0) == (21, 0) and paged.is_sliding == [True, True]


def dynamic_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def test_beam_search_holds_less_than_dynamic_cache():
    """Beams share the prompt's blocks: at the end the cache holds far less than DynamicCache's copy per beam."""
    model = model_for()
    ids = batch((120,), seed=9)[0]
    paged = PagedCache(model.config, block_size=8)
    kwargs = dict(max_new_tokens=10, num_beams=4, do_sample=False, return_dict_in_generate=True)
    out = model.generate(ids, cache=paged, **kwargs)
    ref = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert paged.num_bytes_in_use <= 0.6 * dynamic_bytes(ref.cache), (paged.num_bytes_in_use, dynamic_bytes(ref.cache))


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_layers_give_back_the_blocks_they_no_longer_see(arch):
    """HF's sliding layers keep only their window: a PagedCache's sliding-window layers (mistral: all; gemma2: every
    other) hold only the blocks the window still covers, and read the same results."""
    model = model_for(arch)
    ids, mask = batch((30, 40), seed=13)
    cache = PagedCache(model.config, block_size=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                  return_dict_in_generate=True)
    out = model.generate(ids, cache=cache, **kwargs)
    ref = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    window, length = model.config.sliding_window, cache.get_seq_length()  # 8 and 55
    sliding = [layer.store for layer in cache.layers if layer.sliding_window]
    full = [layer.store for layer in cache.layers if not layer.sliding_window]
    assert sliding and all(store is sliding[0] for store in sliding) and all(store is not sliding[0] for store in full)
    # before the last write at 54: slots before 54 - 8 + 1 = 47 released, i.e. blocks 0-10 of 14 in each row
    assert sliding[0].num_blocks_in_use == 2 * (math.ceil(length / 4) - (length - 1 - window + 1) // 4) == 2 * 3
    for store in full:
        assert store.num_blocks_in_use == 2 * math.ceil(length / 4)


def test_crop_behind_a_released_window_raises_and_recording_keeps_it():
    """Once a sliding window has given slots back, a crop whose next query would need them raises and changes
    nothing; with `activate_past_recording()` (what HF's assisted decoding calls) the slots stay until the crop, and
    the rolled-back cache reads as DynamicCache's."""
    model = model_for("mistral")
    ids = batch((38,), seed=14)[0]
    with torch.no_grad():
        cache = PagedCache(model.config, block_size=4)
        model(ids[:, :6], cache=cache, use_cache=True)
        model(ids[:, 6:7], cache=cache, use_cache=True)
        cache.crop(-3)  # shorter than the window: nothing was released, any crop is fine
        assert cache.get_seq_length() == 4 and cache.store.num_blocks_in_use == 1

        cache = PagedCache(model.config, block_size=4)
        model(ids[:, :30], cache=cache, use_cache=True)
        model(ids[:, 30:31], cache=cache, use_cache=True)  # releases slots before 31 - 8 + 1 = 24 -> 20
        assert cache.store.num_released_tokens == 20
        with pytest.raises(RuntimeError, match="sliding window"):
            cache.crop(-10)
        assert cache.get_seq_length() == 31 and cache.store.num_blocks_in_use == 8 - 5
        cache.crop(-3)  # the next query (28) sees from 21: still there
        assert cache.get_seq_length() == 28

        logits = []
        for cache in (PagedCache(model.config, block_size=4), DynamicCache(config=model.config)):
            cache.activate_past_recording()
            model(ids[:, :30], cache=cache, use_cache=True)
            model(ids[:, 30:34], cache=cache, use_cache=True)
            model(ids[:, 34:38], cache=cache, use_cache=True)  # without recording: slots before 24 released
            cache.crop(-8)  # the next query (30) sees from 23
            logits.append(model(ids[:, 30:32], cache=cache, use_cache=True).logits)
            if isinstance(cache, PagedCache):
                assert cache.store.num_released_tokens == 20  # the crop put the window back in force
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_crop_frees_the_blocks_past_the_cut():
    model = model_for()
    cache = PagedCache(model.config, block_size=4)
    with torch.no_grad():
        model(batch((10, 10), seed=10)[0], cache=cache, use_cache=True)
    held = cache.store.num_blocks_in_use
    assert held == 2 * 3
    cache.crop(-5)
    assert cache.get_seq_length() == 5 and cache.store.num_blocks_in_use == 2 * 2
    assert cache.store.pool.num_free_blocks == cache.store.pool.num_blocks - 4
    with pytest.raises(ValueError):
        cache.crop(3)


def test_layers_return_contiguous_key_values_like_dynamic_cache():
    """Some attention code `.view`s the K/V the cache returns (gpt_neox_japanese): they must be contiguous."""
    from transformers import GPTNeoXJapaneseConfig, GPTNeoXJapaneseForCausalLM

    k = torch.randn(2, 2, 3, 4)
    keys, values = PagedCache().update(k, k + 1, 0)
    assert keys.is_contiguous() and values.is_contiguous()
    torch.manual_seed(0)
    config = GPTNeoXJapaneseConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
                                   intermediate_multiple_size=2)
    model = GPTNeoXJapaneseForCausalLM(config).eval()
    ids = torch.randint(3, 500, (2, 5))
    ref = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, cache=PagedCache(model.config)), ref)


def test_it_is_a_dynamic_cache_to_code_that_asks():
    """transformers' own tests (and users) check that generate's default cache is a DynamicCache."""
    model = model_for()
    ids, mask = batch((4, 9), seed=12)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                         cache_implementation="paged")
    assert isinstance(out.cache, PagedCache) and isinstance(out.cache, DynamicCache)
    keys, values, _ = next(iter(out.cache))
    assert keys.shape[2] == out.cache.get_seq_length() and keys.shape == values.shape
