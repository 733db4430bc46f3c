"""What the start-up check (model/probe.py) must catch, and trocr: a decoder whose own positions count the left padding
of HF's padded batch (its position embedding counts from the cache length, and its forward takes no position ids)."""
import pytest
import torch

import hf_paged.model.paged_forward as paged_forward
from hf_paged import LLM, SamplingParams
from hf_paged.model.probe import counts_padding
from hf_paged.tiny import tiny_model

from conftest import chunk_blind, left_padded_batch, tiny_biogpt

GREEDY = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)


def tiny_trocr(**overrides):
    """A tiny TrOCR decoder whose greedy tokens depend on positions: untied head, weights large enough (the census's
    tied 0.02-std one only repeats the last prompt token, so no difference in positions ever showed)."""
    from transformers import TrOCRConfig, TrOCRForCausalLM

    config = TrOCRConfig(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, vocab_size=256,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, init_std=0.5, **overrides)
    torch.manual_seed(0)
    return TrOCRForCausalLM(config).eval()


def test_trocr_left_padded_batch_is_token_identical_to_hf(one_torch_thread):
    """HF's trocr numbers a padded row's tokens from the first pad; the engine serves each prompt at positions 0..,
    which gave other tokens for every padded row. Such a batch now runs HF's own loop (on a PagedCache)."""
    model = tiny_trocr()
    ids, mask = left_padded_batch([9, 3, 6, 12], seed=1)
    want = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(model.generate(ids, attention_mask=mask, cache_implementation="paged", **GREEDY), want)


def test_trocr_unpadded_prompts_are_served_by_the_engine_exactly(one_torch_thread):
    model = tiny_trocr()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    got = LLM(model).generate(prompts, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0),
                              use_tqdm=False)
    for prompt, out in zip(prompts, got):
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want


def test_trocr_with_positions_from_its_token_ids_is_refused_naming_it():
    """The sinusoidal variant numbers tokens from the (packed) token ids themselves: refused, saying which module."""
    with pytest.raises(ValueError, match=r"'trocr'.*TrOCRSinusoidalPositionalEmbedding computes positions itself"):
        LLM(tiny_trocr(use_learned_position_embeddings=False))


def test_counts_padding_tells_models_that_number_the_padding():
    assert counts_padding(tiny_trocr())
    assert not counts_padding(tiny_model("llama"))  # its positions come from the mask (HF's generate passes them)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counts_padding_in_half_precision_asks_more_prompts(monkeypatch, dtype):
    """fp32: one prompt decides. bf16 / fp16: a padded row may round otherwise (a router's near tie can make that a
    large difference on some prompts), so the padding counts only if every one of HALF_PROMPTS prompts differs."""
    from hf_paged.model import probe

    assert counts_padding(tiny_trocr().to(dtype))  # a padding that counts changes every prompt, in bf16 too
    asked = []

    def differs(model, seed):
        asked.append(seed)
        return seed in scripted

    monkeypatch.setattr(probe, "_padding_differs", differs)
    model = tiny_model("llama").to(dtype)
    half = dtype is torch.bfloat16
    monkeypatch.setattr(probe.verdict_disk, "load", lambda *a: None)
    for scripted, want, prompts in (({1}, not half, [1, 2] if half else [1]),
                                    ({1, 2, 3}, True, [1, 2, 3] if half else [1]), (set(), False, [1])):
        model.__dict__.pop("_hf_paged_counts_padding", None)
        asked.clear()
        assert counts_padding(model) is want and asked == prompts


def test_the_check_catches_positions_wrong_only_after_cached_context(monkeypatch, one_torch_thread):
    """Positions that are right for a prefill from position 0 and for a one-token decode, but count a chunk of
    several tokens after cached context from 0 (as a module counting from a cache length of 0 would): chunked
    prefill would be silently wrong. The check's steps include such chunks, so the model is refused."""
    model = tiny_biogpt()
    LLM(model)  # served as it is
    model.__dict__.pop("_hf_paged_probe", None)
    monkeypatch.setattr(paged_forward, "sequence_positions", chunk_blind(paged_forward.sequence_positions))
    with pytest.raises(ValueError, match="'biogpt'.*does not reproduce"):
        LLM(model)


@pytest.mark.parametrize("impl", ["paged|eager"])  # ("paged|sdpa" is turned into "sdpa" by transformers itself)
def test_a_model_loaded_for_transformers_batching_is_compared_with_its_plain_attention(impl, one_torch_thread):
    """transformers' "paged|..." attention applies no causal mask outside its own batching loop: the start-up check
    takes the model's reference logits from the plain attention after the "|" (else such a model was refused)."""
    model, plain = tiny_model("llama", attn_implementation=impl), tiny_model("llama")
    ids, mask = left_padded_batch([5, 9, 3], seed=4)
    assert not counts_padding(model)  # so a padded batch runs on the engine, not in HF's loop
    out = model.generate(ids, attention_mask=mask, cache_implementation="paged", **GREEDY)
    assert out.tolist() == plain.generate(ids, attention_mask=mask, **GREEDY).tolist()
    assert model.config._attn_implementation == impl  # left as found
