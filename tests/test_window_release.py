"""The engine on a model whose every layer attends through one sliding window (mistral): a running request's blocks
wholly behind the window go back to the pool before each step, so it holds about a window's worth, whatever its
length. Outputs stay exactly those of the same engine keeping every block, under preemption by swap and by
recompute, prefix hits, chunked prefill, parallel samples (forks) and aborts; a model with mixed layers (gemma2)
releases nothing. The window comes from what the model's attention does (the start-up check), not from a flag."""
from __future__ import annotations

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.kv import NULL_BLOCK, blocks_needed

from conftest import assert_same_as_hf, cached_model, left_padded_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 16


def windowed():
    return cached_model("mistral", sliding_window=WINDOW)


def prompts(count: int, seed: int, lengths=(4, 12)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(n),), generator=gen).tolist()
            for n in torch.randint(lengths[0], lengths[1], (count,), generator=gen)]


def run(model, prompt_ids, params, keep_every_block=False, **options):
    """Outputs and the LLM; with `keep_every_block` the same engine with the window release switched off."""
    llm = LLM(model, **options)
    if keep_every_block:
        llm.engine.scheduler.release_window = None
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    llm.engine.check_idle()  # every block free, every reference count zero, nothing on the swap pool
    return [[sample.token_ids for sample in out.outputs] for out in outs], llm


def test_the_window_comes_from_the_model():
    assert LLM(windowed(), block_size=4, num_blocks=64).engine.scheduler.release_window == WINDOW
    assert LLM(cached_model("gemma2"), block_size=4, num_blocks=64).engine.scheduler.release_window is None  # every other layer
    assert LLM(cached_model("llama"), block_size=4, num_blocks=64).engine.scheduler.release_window is None


def test_a_request_holds_a_window_of_blocks_and_hf_output():
    """Stepping one long request: after each step its table holds at most the window's blocks (plus the one being
    filled and, with prefix caching, the last published one), its released entries are a leading run of the null
    block, and the result is HF's."""
    model = windowed()
    llm = LLM(model, block_size=4)
    prompt = prompts(1, seed=1, lengths=(30, 31))[0]
    group = llm.engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    request = group.samples[0]
    held_after_prefill = None
    while llm.engine.has_unfinished:
        llm.engine.step()
        table = request.block_table
        live = [b for b in table if b != NULL_BLOCK]
        released = len(table) - len(live)
        assert table[:released] == [NULL_BLOCK] * released  # a leading run
        if held_after_prefill is None:
            held_after_prefill = len(live)  # the whole prompt: nothing computed was behind a window yet
        else:  # the window's blocks, the one being written, and the last published one (it chains the next)
            assert len(live) <= blocks_needed(WINDOW, 4) + 2, (len(live), table)
    assert held_after_prefill == blocks_needed(len(prompt), 4)
    assert llm.stats()["num_blocks_released"] >= blocks_needed(len(prompt) + 59, 4) - blocks_needed(WINDOW, 4) - 2
    ids = torch.tensor([prompt])
    hf = model.generate(ids, max_new_tokens=60, min_new_tokens=60, do_sample=False)[0, len(prompt):].tolist()
    assert request.output_token_ids == hf


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_generate_takeover_matches_hf_past_the_window(arch, engine_runs):
    model = cached_model(arch, sliding_window=WINDOW)
    ids, mask = left_padded_batch([40, 7, 25, 18], seed=2)
    assert_same_as_hf(model, ids, mask, paged_kwargs={"cache_config": {"block_size": 2}}, max_new_tokens=40,
                      do_sample=False)
    assert engine_runs[0].engine.stats()["num_blocks_released"] > 0


def staggered(mode: str, prefix: bool, keep_every_block: bool = False):
    """Three long requests (priority 1: preempted first) run past the window, then five short, more urgent ones
    arrive and grow until the pool runs dry: the victims are requests that have given blocks back."""
    # swap space for the three victims' live blocks (at most 10 each), not for their whole tables (up to 21 each)
    swap_space = 32 * LLM(windowed(), block_size=2, num_blocks=8).engine.spec.kv.bytes_per_block(2)
    llm = LLM(windowed(), preemption_mode=mode, enable_prefix_caching=prefix, block_size=2, num_blocks=48,
              swap_space=swap_space)
    if keep_every_block:
        llm.engine.scheduler.release_window = None
    params = SamplingParams(max_tokens=60, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    groups = [llm.engine.add_request(p, params, priority=1) for p in prompts(3, seed=8, lengths=(20, 30))]
    for _ in range(8):
        llm.engine.step()
    groups += [llm.engine.add_request(p, params) for p in prompts(5, seed=9, lengths=(4, 8))]
    while llm.engine.has_unfinished:
        llm.engine.step()
    llm.engine.check_idle()
    assert llm.engine.scheduler.kv.pool.blocks[NULL_BLOCK].block_hash is None  # never published as a prefix
    return [g.samples[0].output_token_ids for g in groups], llm.stats()


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_of_requests_with_released_blocks(mode, prefix):
    """Preempted requests whose tables start with released blocks: swapped out (only their live blocks) and back
    in behind the same released run, or recomputed, with the outputs of the engine that keeps every block."""
    expected, _ = staggered(mode, prefix, keep_every_block=True)
    got, stats = staggered(mode, prefix)
    assert got == expected
    assert stats["num_preemptions"] > 0 and stats["num_blocks_released"] > 0, stats
    if mode == "swap":
        assert stats["num_swap_outs"] == stats["num_swap_ins"] > 0 and stats["num_recomputed_tokens"] == 0


def test_prefix_hits_chunks_and_parallel_samples():
    """A shared 40-token prefix (hits on blocks a finished request released), chunked prefill and n=3 samples forked
    from one prompt, against the same engine keeping every block."""
    model = windowed()
    shared = list(range(10, 50))
    ids = [shared + tail for tail in prompts(6, seed=5, lengths=(1, 6))]
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=6, n=3, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    expected, _ = run(model, ids, params, keep_every_block=True, **options)
    got, llm = run(model, ids, params, **options)
    assert got == expected
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["num_blocks_released"] > 0, stats


def test_abort_mid_run_frees_everything():
    model = windowed()
    llm = LLM(model, block_size=2)
    groups = [llm.engine.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
              for p in prompts(4, seed=7)]
    for _ in range(25):
        llm.engine.step()
    assert all(not g.is_finished for g in groups)
    assert llm.stats()["num_blocks_released"] > 0
    for group in groups:
        llm.engine.abort(group.request_id)
    while llm.engine.has_unfinished:
        llm.engine.step()
    llm.engine.check_idle()


def test_the_returned_cache_knows_what_the_window_released():
    """`generate(..., return_dict_in_generate=True)` returns a PagedCache whose sliding layers hold only what their
    next query sees (the engine gave the rest back): continuing equals one longer call, and a crop that would need the
    released positions raises instead of continuing from zeros (HF's own sliding layer raises there too)."""
    model = windowed()
    ids = torch.tensor(prompts(1, seed=10, lengths=(30, 31)))
    kwargs = dict(do_sample=False, cache_implementation="paged", cache_config={"block_size": 2})
    first = model.generate(ids, max_new_tokens=30, min_new_tokens=30, return_dict_in_generate=True, **kwargs)
    assert first.cache.store.num_released_tokens == 60 - WINDOW  # the next query (at 59) sees from 44
    with pytest.raises(RuntimeError, match="sliding window"):
        first.cache.crop(-20)
    rest = model.generate(first.sequences, cache=first.cache, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(rest, model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False))


def test_non_finite_k_v_behind_the_window_is_never_served_again():
    """A request whose prompt goes non-finite mid-way (a NaN embedding row) ends with an error; the blocks its window
    already gave back hold NaN too: they leave the prefix map and are cleared before reuse, so the same prompt run
    cleanly afterwards equals an engine that keeps every block."""
    model = windowed()
    poison = 77
    prompt = list(range(100, 110)) + [poison] + list(range(120, 154))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    results = []
    for keep in (True, False):
        llm = LLM(model, block_size=2, num_blocks=64, long_prefill_token_threshold=6)
        if keep:
            llm.engine.scheduler.release_window = None
        weight = model.get_input_embeddings().weight
        saved = weight.data[poison].clone()
        weight.data[poison] = float("nan")
        try:
            poisoned = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        finally:
            weight.data[poison] = saved
        assert poisoned.finish_reason == "error"
        assert keep or llm.stats()["num_blocks_released"] > 0
        kv, storage = llm.engine.scheduler.kv, llm.engine.memory.cache.storage
        assert storage.isnan().any(), "the poison never reached the cache: the test would prove nothing"
        for block in range(1, kv.pool.num_blocks + 1):  # a block handed out uncleared must hold no NaN
            assert not (kv._clean[block] and storage[:, :, block].isnan().any()), block
        clean = llm.generate([prompt, prompts(1, seed=11, lengths=(40, 41))[0]], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in clean])
        assert all(o.outputs[0].finish_reason == "length" for o in clean)
        llm.engine.check_idle()
    assert results[0] == results[1]


def test_a_changed_window_is_checked_again():
    """The window is what the model's attention does now: changing the config's window starts a fresh check."""
    model = tiny_model_with_window(8)
    assert LLM(model, block_size=2, num_blocks=64).engine.scheduler.release_window == 8
    model.config.sliding_window = 24
    assert LLM(model, block_size=2, num_blocks=64).engine.scheduler.release_window == 24
    ids, mask = left_padded_batch([30, 12], seed=12)
    assert_same_as_hf(model, ids, mask, paged_kwargs={"cache_config": {"block_size": 2}}, max_new_tokens=30,
                      do_sample=False)


def tiny_model_with_window(window: int):
    from hf_paged.tiny import tiny_model

    return tiny_model("mistral", sliding_window=window)  # a private copy: the test changes its config
