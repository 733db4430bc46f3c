"""Greedy `generate(cache_implementation="paged")` equals HF `generate` token for token."""
import pytest

from hf_paged.tiny import ARCHITECTURES

from conftest import assert_same_as_hf, cached_model, left_padded_batch

LENGTHS = [5, 17, 11, 24, 3]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_left_padded_mixed_lengths(arch):
    model = cached_model(arch)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    assert_same_as_hf(model, ids, mask, max_new_tokens=20, do_sample=False)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gpt2"])
def test_small_blocks_and_forced_preemption(arch, engine_runs):
    """A pool far smaller than the batch needs: requests are preempted and recomputed, results unchanged."""
    model = cached_model(arch)
    ids, mask = left_padded_batch(LENGTHS, seed=2)
    assert_same_as_hf(model, ids, mask, paged_kwargs={"cache_config": {"block_size": 4, "num_blocks": 14}},
                      max_new_tokens=24, do_sample=False)
    assert len(engine_runs) == 1, f"expected the paged call to run on the engine once, got {len(engine_runs)}"
    preemptions = engine_runs[0].engine.stats()["num_preemptions"]
    assert preemptions > 0, f"{arch}: no request was preempted, so the pool was not small enough to test preemption"


def test_chunked_prefill_small_budget():
    model = cached_model("qwen3")
    ids, mask = left_padded_batch([30, 9, 21], seed=3)
    assert_same_as_hf(model, ids, mask, paged_kwargs={"cache_config": {"max_num_batched_tokens": 7, "block_size": 8}},
                      max_new_tokens=12, do_sample=False)


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt_neox", "mixtral"])
def test_early_eos_ragged_finish(arch):
    """Pick as EOS a token HF generates mid-way for one row: rows finish at different steps, pads follow."""
    model = cached_model(arch)
    ids, mask = left_padded_batch(LENGTHS, seed=4)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    eos = int(free[1, ids.shape[1] + 4])
    out = assert_same_as_hf(model, ids, mask, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0)
    finished_at = [(row[ids.shape[1]:] == eos).nonzero() for row in out]
    assert any(len(f) for f in finished_at), "the chosen EOS never appeared: the test would prove nothing"
    assert (out[:, ids.shape[1]:] == 0).any(), "no row finished early"


def test_mistral_sliding_window_is_exercised():
    model = cached_model("mistral")
    assert model.config.sliding_window < 30
    ids, mask = left_padded_batch([28, 14], seed=5)
    assert_same_as_hf(model, ids, mask, max_new_tokens=20, do_sample=False)
