"""Prefix reuse, chunked prefill and recompute preemption never change outputs, and memory balances."""
import pytest
import torch

import hf_paged.kv.hashing as hashing
from hf_paged import LLM, SamplingParams

from conftest import cached_model

SYSTEM = list(range(10, 58))  # a 48-token shared "system prompt"


def shared_prefix_prompts(count=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [SYSTEM + torch.randint(60, 250, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 12, (count,), generator=gen)]


def run(model, prompts, params, **options):
    llm = LLM(model, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_idle()  # every block free, every reference count zero
    return [o.token_ids for o in outs], llm


SETTINGS = {
    "plain": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    "prefix": dict(enable_prefix_caching=True),
    "prefix+chunks": dict(enable_prefix_caching=True, max_num_batched_tokens=16, long_prefill_token_threshold=8),
    "prefix+tiny pool": dict(enable_prefix_caching=True, block_size=4, num_blocks=30),
    "tiny pool, no prefix": dict(enable_prefix_caching=False, block_size=4, num_blocks=30),
}


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen3"])
@pytest.mark.parametrize("sampled", [False, True])
def test_outputs_identical_across_settings(arch, sampled):
    model = cached_model(arch)
    params = (SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=7, ignore_eos=True) if sampled
              else SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    prompts = shared_prefix_prompts()
    expected, _ = run(model, prompts, params, **SETTINGS["plain"])
    for name, options in SETTINGS.items():
        got, llm = run(model, prompts, params, **{"block_size": 8, **options})
        assert got == expected, f"{arch} {'sampled' if sampled else 'greedy'}: outputs changed with {name}"
        if "tiny" in name and arch in ("mistral", "gemma2"):  # windows give blocks back: this pool never runs dry
            assert llm.stats()["num_blocks_released"] > 0  # preemption with released blocks: test_window_release.py
        elif "tiny" in name:
            assert llm.stats()["num_preemptions"] > 0, f"{name}: pool too large to force preemption"


def test_hits_are_counted_and_reported(llama):
    llm = LLM(llama, block_size=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate([SYSTEM + [70, 71]], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate([SYSTEM + [80, 81, 82]], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 48  # six full blocks of the shared prompt
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] == 48
    assert stats["prefix_cache_query_tokens"] == 50 + 51
    # the last token is always recomputed, even for a prompt that is entirely cached
    again = llm.generate([SYSTEM], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 40
    alone, _ = run(llama, [SYSTEM + [80, 81, 82]], params, enable_prefix_caching=False)
    assert second.token_ids == alone[0]


def test_different_salts_never_share(llama):
    llm = LLM(llama, block_size=8)
    salted = SamplingParams(max_tokens=3, temperature=0.0, cache_salt="tenant-a")
    other = SamplingParams(max_tokens=3, temperature=0.0, cache_salt="tenant-b")
    llm.generate([SYSTEM + [90]], salted, use_tqdm=False)
    assert llm.generate([SYSTEM + [91]], other, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([SYSTEM + [92]], SamplingParams(max_tokens=3, temperature=0.0),
                        use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([SYSTEM + [93]], salted, use_tqdm=False)[0].num_cached_tokens == 48


def test_the_empty_salt_is_a_salt(llama):
    """cache_salt="" shares blocks only with "" (it used to hash like no salt and share with unsalted requests)."""
    llm = LLM(llama, block_size=8)
    empty = SamplingParams(max_tokens=3, temperature=0.0, cache_salt="")
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    llm.generate([SYSTEM + [90]], plain, use_tqdm=False)
    assert llm.generate([SYSTEM + [91]], empty, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([SYSTEM + [92]], empty, use_tqdm=False)[0].num_cached_tokens == 48
    assert llm.generate([SYSTEM + [93]], plain, use_tqdm=False)[0].num_cached_tokens == 48


def test_colliding_hash_still_gives_correct_output(llama, monkeypatch):
    """Every block key equal: hits must still be proven by tokens and by the exact parent block."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    repeated = [SYSTEM[:8] * 4 + [100 + i] for i in range(3)] + [SYSTEM[8:16] + SYSTEM[:8] * 3 + [120]]
    expected, _ = run(llama, repeated, params, enable_prefix_caching=False, block_size=8)
    monkeypatch.setattr(hashing, "hash_block", lambda parent, tokens, salt: b"same-key-always!")
    monkeypatch.setattr("hf_paged.kv.manager.hash_block", lambda parent, tokens, salt: b"same-key-always!")
    llm = LLM(llama, block_size=8)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in repeated]
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_cached_tokens for o in outs) > 0, "no prefix hit at all: the colliding keys were never looked up"
    llm.engine.check_idle()


def test_n_samples_share_the_prompt(llama):
    """n samples compute the prompt once and share its blocks; the partly filled block is copied on write."""
    prompt = SYSTEM + [61, 62, 63]  # 51 tokens: 6 full blocks of 8 and a shared partial one
    params = SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=3, ignore_eos=True)
    llm = LLM(llama, block_size=8)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.stats()["num_batched_tokens"] == len(prompt) + 4 * (6 - 1)  # prompt once, then 4 decodes per step
    for sample, completion in enumerate(out.outputs):  # each sample equals the same seed run alone
        alone = SamplingParams(max_tokens=6, temperature=1.0, seed=3 + sample, ignore_eos=True)
        assert completion.token_ids == LLM(llama, block_size=8).generate([prompt], alone,
                                                                          use_tqdm=False)[0].token_ids
    llm.engine.check_idle()


def test_forked_samples_survive_preemption(llama):
    prompt = SYSTEM[:21]
    params = SamplingParams(max_tokens=20, temperature=0.9, n=3, seed=5, ignore_eos=True)
    roomy = LLM(llama, block_size=4).generate([prompt, prompt[:13]], params, use_tqdm=False)
    for mode in ("recompute", "swap"):
        tight = LLM(llama, block_size=4, num_blocks=24, preemption_mode=mode, swap_space=1 << 20)
        outs = tight.generate([prompt, prompt[:13]], params, use_tqdm=False)
        assert tight.stats()["num_preemptions"] > 0
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in roomy]
        tight.engine.check_idle()


def test_lru_keeps_cached_blocks_until_needed(llama):
    llm = LLM(llama, block_size=8, num_blocks=20)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([SYSTEM + [70]], params, use_tqdm=False)
    assert llm.stats()["num_cached_blocks"] == 6 and llm.stats()["num_blocks_free"] == 20
    # unrelated traffic first takes never-cached blocks; the cached prefix survives
    llm.generate([[200 + i for i in range(30)]], params, use_tqdm=False)
    assert llm.generate([SYSTEM + [71]], params, use_tqdm=False)[0].num_cached_tokens == 48
    # a request needing the whole pool evicts them (least recently used first) instead of failing
    llm.generate([list(range(3, 150))], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert llm.generate([SYSTEM + [72]], params, use_tqdm=False)[0].num_cached_tokens < 48
    llm.engine.check_idle()


SWAP = dict(block_size=4, num_blocks=30, swap_space=1 << 20)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen3"])
@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
def test_preemption_modes_keep_outputs(arch, mode):
    model = cached_model(arch)
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=11, ignore_eos=True)
    prompts = shared_prefix_prompts(seed=5)
    expected, _ = run(model, prompts, params, enable_prefix_caching=False)
    got, llm = run(model, prompts, params, preemption_mode=mode, **SWAP)
    assert got == expected
    stats = llm.stats()
    if arch == "mistral":  # its window gives blocks back: this pool never runs dry (see test_window_release.py)
        assert stats["num_blocks_released"] > 0
        return
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] == stats["num_preemptions"] == stats["num_swap_ins"] > 0
        assert stats["num_blocks_swapped"] > 0 and stats["num_recomputed_tokens"] == 0
    if mode == "recompute":
        assert stats["num_swap_outs"] == 0 and stats["num_recomputed_tokens"] > 0


def test_full_swap_space_falls_back_to_recompute(llama):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = shared_prefix_prompts(seed=6)
    expected, _ = run(llama, prompts, params, enable_prefix_caching=False)
    one_block = LLM(llama, block_size=4).engine.spec.kv.bytes_per_block(4)
    got, llm = run(llama, prompts, params, preemption_mode="swap", block_size=4, num_blocks=30,
                   swap_space=2 * one_block)
    assert got == expected
    stats = llm.stats()
    assert stats["num_swap_outs"] == 0 and stats["num_recomputed_tokens"] > 0  # never enough room: recompute


def test_priority_decides_who_is_preempted(llama):
    """The request with the larger priority value is preempted first, whatever its arrival (without priorities
    `later`, the newest, would go first); every request still finishes with the tokens of an unpreempted run."""
    prompts = [SYSTEM[:30], SYSTEM[10:40], SYSTEM[20:50]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(llama, block_size=4, num_blocks=24, preemption_mode="recompute")
    important = llm.add_request(prompts[0], params, priority=0)
    background = llm.add_request(prompts[1], params, priority=5)
    later = llm.add_request(prompts[2], params, priority=0)
    preempted, finished = [], {}

    def preemptions():
        return {rid: sum(r.num_preemptions for r in group.samples) for rid, group in llm.engine.parents.items()}

    while llm.has_unfinished_requests():
        before = preemptions()
        finished.update((out.request_id, out.token_ids) for out in llm.step() if out.finished)
        preempted += [rid for rid, count in preemptions().items() if count > before.get(rid, 0)]
    assert preempted and preempted[0] == background
    assert important not in preempted
    llm.engine.check_idle()
    roomy, _ = run(llama, prompts, params, block_size=4)
    assert [finished.get(rid) for rid in (important, background, later)] == roomy


def test_burst_waits_for_the_shared_prefix_instead_of_recomputing_it(llama):
    """Requests arriving together behind one that is computing their common prefix reuse it."""
    prompts = shared_prefix_prompts(6, seed=9)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(llama, block_size=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] + [48] * 5
    plain, _ = run(llama, prompts, params, enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == plain
