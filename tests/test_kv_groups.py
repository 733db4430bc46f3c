"""KV groups on the engine: stacks mixing sliding-window (or chunked: llama4) and full-attention layers (gemma3,
gemma2, cohere2, gpt-oss, llama4)
hold a block table per group, give each sliding group's blocks behind its window back, and stay token-exact with HF
under pressure (chunked prefill, preemption by swap and by recompute, prefix hits, n samples, CUDA-graph padding)."""
import pytest
import torch

import hf_paged
from hf_paged.kv import KVCacheManager, held
from hf_paged.kv.groups import KVGroup, plan_groups
from hf_paged.tiny import MIXED, tiny_mixed

from conftest import assert_same_as_hf, left_padded_batch

WINDOW = 8
GREEDY = hf_paged.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(model_type):
        if model_type not in made:
            made[model_type] = tiny_mixed(model_type, window=WINDOW)
        return made[model_type]
    return get


def prompts(lengths=(5, 23, 41, 14), seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def run(model, prompt_list, params=GREEDY, **options):
    llm = hf_paged.LLM(model, **{"num_blocks": 128, "block_size": 2, **options})
    outs = llm.generate(prompt_list, params, use_tqdm=False)
    llm.engine.check_idle()  # every block back, every reference count zero
    return [[list(c.token_ids) for c in o.outputs] for o in outs], llm


def tight_pool(llm, longest: int, chunk: int | None = None) -> int:
    """`num_blocks` (blocks of every layer) that just holds a request of `longest` tokens: any two must take turns."""
    kv = llm.engine.scheduler.kv
    ids_per_block = kv.pool.num_blocks // llm.engine.config.num_blocks
    saved, kv.max_chunk = kv.max_chunk, chunk or kv.max_chunk
    need = kv.blocks_for(longest)
    kv.max_chunk = saved
    return -(-need // ids_per_block) + 1


def hf_alone(model, batch, new=24):
    return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in batch]


# ---- the plan -----------------------------------------------------------------------------------------------------
def test_plan_groups_splits_kinds_into_groups_of_one_size():
    assert plan_groups({0: 8, 1: 8, 2: None, 3: 8}) == (KVGroup((0,), 8), KVGroup((1,), 8), KVGroup((2,), None),
                                                        KVGroup((3,), 8))
    five_to_one = plan_groups({i: (None if i % 6 == 5 else 128) for i in range(12)})
    assert [len(g.layers) for g in five_to_one] == [2] * 6  # 10 sliding : 2 full -> groups of 2
    assert sorted(layer for g in five_to_one for layer in g.layers) == list(range(12))
    assert plan_groups({0: None, 1: None}) == (KVGroup((0, 1), None),)  # one kind: one group, one tensor per layer
    assert plan_groups({0: 8, 1: 8}) == (KVGroup((0, 1), 8),)


@pytest.mark.parametrize("model_type", sorted(MIXED))
def test_each_window_is_a_group_with_its_own_table(models, model_type):
    model = models(model_type)
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    kv = llm.engine.scheduler.kv
    kinds = model.config.layer_types
    assert kv.num_groups > 1
    for group in kv.groups:
        kind = "chunked_attention" if group.chunk else "sliding_attention" if group.window else "full_attention"
        assert {kinds[layer] for layer in group.layers} == {kind}
        assert group.window in (None, WINDOW) and group.chunk in (None, WINDOW)
    cache = llm.engine.memory.cache
    assert cache.storage.shape[0] == max(len(g.layers) for g in kv.groups)  # a group's worth of layer tensors
    assert kv.pool.num_blocks == 64 * len(kinds) // cache.storage.shape[0]  # num_blocks: blocks of every layer


# ---- exact under pressure -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", sorted(MIXED))
def test_generate_takeover_matches_hf(models, engine_runs, model_type):
    model = models(model_type)
    ids, mask = left_padded_batch([5, 23, 17], seed=3)
    assert_same_as_hf(model, ids, mask, max_new_tokens=20, do_sample=False)
    assert engine_runs and engine_runs[0].engine.stats()["num_blocks_released"] > 0


@pytest.mark.parametrize("model_type", sorted(MIXED))
def test_pressure_gives_hfs_tokens(models, model_type):
    """Chunked prefill with a budget smaller than a prompt, a pool small enough to preempt (by recompute, then by
    swap): HF's tokens; sliding groups gave blocks back."""
    model = models(model_type)
    batch = prompts()
    alone = hf_alone(model, batch)
    roomy, llm = run(model, batch)
    assert [r[0] for r in roomy] == alone
    assert llm.stats()["num_blocks_released"] > 0
    pressed, llm = run(model, batch, num_blocks=tight_pool(llm, max(map(len, batch)) + 24, chunk=5),
                       max_num_batched_tokens=6, long_prefill_token_threshold=5, preemption_mode="recompute")
    assert pressed == roomy
    assert llm.stats()["num_preemptions"] > 0
    swapped, llm = run(model, batch, num_blocks=tight_pool(llm, max(map(len, batch)) + 24, chunk=5),
                       max_num_batched_tokens=6, long_prefill_token_threshold=5, preemption_mode="swap",
                       swap_space=1 << 20)
    assert swapped == roomy
    stats = llm.stats()
    assert stats["num_swap_outs"] > 0 and stats["num_recomputed_tokens"] == 0


def test_n_samples_fork_every_groups_table(models):
    """n=3 seeded samples share their prompt's blocks in every group (copy-on-write where they write): the same
    samples with a roomy pool, under recompute pressure and without prefix caching."""
    model = models("gemma3_text")
    params = hf_paged.SamplingParams(max_tokens=16, temperature=0.9, seed=5, n=3, ignore_eos=True)
    roomy, _ = run(model, prompts(), params, num_blocks=200)
    assert all(len({tuple(s) for s in samples}) > 1 for samples in roomy)  # the samples differ: forks are real
    pressed, llm = run(model, prompts(), params, num_blocks=36, preemption_mode="recompute")
    assert pressed == roomy and llm.stats()["num_preemptions"] > 0
    plain, _ = run(model, prompts(), params, enable_prefix_caching=False)
    assert plain == roomy


# ---- prefix hits need only what each group sees ---------------------------------------------------------------------
def shared_prefix(prefix_len=44, suffixes=(3, 5, 2), seed=4):  # 44: mid-chunk, mid-window
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (prefix_len,), generator=gen).tolist()
    return [shared + torch.randint(3, 256, (n,), generator=gen).tolist() for n in suffixes]


@pytest.mark.parametrize("model_type", ("gemma3_text", "gpt_oss", "llama4_text"))
def test_prefix_hits_are_exact(models, model_type):
    model = models(model_type)
    batch = shared_prefix()
    plain, _ = run(model, batch, enable_prefix_caching=False)
    llm = hf_paged.LLM(model, num_blocks=128, block_size=2)  # hits end mid-window / mid-chunk
    outs = []
    for prompt in batch:  # one after another: each later prompt finds the first one's blocks
        outs.append([list(c.token_ids) for c in llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs])
    assert outs == plain
    assert llm.stats()["prefix_cache_hit_tokens"] >= 2 * 40


def test_a_sliding_hit_needs_only_the_blocks_its_window_sees():
    """Full group: the whole chain. Sliding group: the blocks behind its window may be gone from the prefix map (given
    back and reused) and the hit still holds; once a block it does see is gone, the hit ends before it."""
    bs, window = 4, 8
    kv = KVCacheManager(32, bs, groups=(KVGroup((0,), window), KVGroup((1,), None)))

    class Seq:
        def __init__(self, tokens):
            self.all_token_ids, self.block_tables, self.block_hashes = list(tokens), [], []
            self.num_published_blocks, self.stale_kv, self.state_slot, self.num_computed_tokens = 0, False, -1, 0
            self.num_tokens = self.num_prompt_tokens = len(tokens)
            self.cache_salt = None

    first = Seq(range(10, 35))  # 25 tokens: 6 full blocks
    kv.admit(first, kv.computed_blocks(first))
    assert kv.allocate_slots(first, 25)
    first.num_computed_tokens = 25
    kv.cache_full_blocks(first)
    sliding, full = (list(table) for table in first.block_tables)
    assert kv.release_behind(first, 25) == 4  # sliding: blocks 0-3 (slots 0-15) are behind slot 25 - 8 + 1
    kv.free(first)
    for block in sliding[:2]:  # given back and since reused: gone from the prefix map
        kv.pool.uncache(block)
    hits = kv.computed_blocks(Seq(range(10, 35)))
    assert len(hits) == 6
    assert [row[0] is None for row in hits] == [True] * 4 + [False] * 2  # a query at slot 24 sees slots 17..24
    assert [row[1].block_id for row in hits] == full[:6]
    assert [row[0].block_id for row in hits[4:]] == sliding[4:6]
    kv.pool.uncache(sliding[4])  # a block the window sees from slot 24 (and 20): those hits are off
    hits = kv.computed_blocks(Seq(range(10, 35)))
    assert len(hits) == 4  # a query at slot 16 sees slots 9..16: blocks 2-3, still cached
    assert [row[0] is None for row in hits] == [True, True, False, False]
    assert [row[0].block_id for row in hits[2:]] == sliding[2:4]


# ---- memory ----------------------------------------------------------------------------------------------------------
def test_a_generation_holds_its_window_in_sliding_groups(models):
    """Long greedy generations: decoding, each sliding group holds at most the blocks its window sees (plus the one
    being written), the full group every block. (A prompt's step holds its chunk for that step.)"""
    model = models("gemma3_text")
    llm = hf_paged.LLM(model, num_blocks=200, block_size=4)
    engine = llm.engine
    for prompt in prompts((30, 7)):
        engine.add_request(prompt, hf_paged.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    kv, most = engine.scheduler.kv, 0
    while engine.has_unfinished:
        engine.step()
        for request in engine.scheduler.running:
            for group, table in zip(kv.groups, request.block_tables):
                count = len(held(table))
                if group.window is None:
                    assert count >= request.num_computed_tokens // 4
                elif request.num_computed_tokens > request.num_prompt_tokens:  # its last step was a decode
                    most = max(most, count)
    assert 0 < most <= WINDOW // 4 + 2  # the window's blocks and the partly written one
    engine.check_idle()
