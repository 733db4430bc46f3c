"""Hybrid (attention + state layers) and state-space models on the engine: token-exact with HF, also under pressure.

Each family is built tiny with 4 layers holding every layer type of its own pattern (`hf_paged.tiny.HYBRIDS`), its
output head sharpened. The state of a state layer lives in the engine's state slots (`kv.StateSlots`), one per
running request; the model's own state modules compute it (`model.state_layers`).
"""
from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.engine.runner import ModelRunner
from hf_paged.kv.state import StateSlots
import hf_paged.model.spec as model_spec
import hf_paged.model.state_layers as state_layers
from hf_paged.model.state_layers import TOKEN_BY_TOKEN, StateView
from hf_paged.model.state_modules import find_state_modules
from hf_paged.tiny import HYBRIDS, tiny_hybrid

from conftest import assert_same_as_hf, left_padded_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread, no spinning on a busy machine
FAMILIES = sorted(HYBRIDS)
PRESSED = ("qwen3_5_text", "mamba2", "falcon_h1", "lfm2", "mamba", "falcon_mamba", "zamba", "minimax", "inkling_text",
           "recurrent_gemma", "rwkv")
# Mamba-1: their own scan drops the previous state for a multi-token input (state_continuation)
MAMBA_1 = ("mamba", "falcon_mamba", "jamba")
# their own multi-token path starts the convolution from zeros: continuations token by token (model/own_state.py)
CONV_RESTART = ("recurrent_gemma",)  # continues token by token (test_state_continuation.py)
# HF's own padded batch is no reference: its forward feeds the padding through its state and its batched single-token
# step mixes sequences (tests/test_own_state.py compares each prompt with HF's generate on it alone)
NO_BATCH_REFERENCE = ("rwkv",)


@pytest.fixture(autouse=True)
def poisoned_free_slots(monkeypatch):
    """A freed state slot is filled with garbage (as if another request had written it): any path that reads a state
    it did not write or restore first gives other tokens."""
    original = StateSlots.free

    def free(self, slot):
        original(self, slot)
        with torch.inference_mode():
            for tensor in self.tensors.values():
                tensor[slot] = 7.0

    monkeypatch.setattr(StateSlots, "free", free)
    write = StateSlots.write

    def poisoned_write(self, key, slots, values, *rest):  # a slot's state tensor starts as garbage, not zeros
        new = key not in self.tensors
        write(self, key, slots, values, *rest)
        if new:
            with torch.inference_mode():
                rest = torch.ones(self.capacity, dtype=torch.bool)
                rest[slots.cpu()] = False
                self.tensors[key][rest.to(self.tensors[key].device)] = 7.0

    monkeypatch.setattr(StateSlots, "write", poisoned_write)


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(model_type):
        if model_type not in built:
            built[model_type] = tiny_hybrid(model_type)
            if model_type in MAMBA_1:
                strong_state(built[model_type])
            if model_type == "inkling_text":
                strong_relative_bias(built[model_type])
        return built[model_type]
    return get


def strong_relative_bias(model, sharpen=2.0, scale=50.0, output=20.0):
    """A tiny random inkling's attention barely reaches its tokens (it attends almost uniformly, its relative-position
    bias is ~1 % of its scores, its output projection small beside the residual): queries and keys `sharpen` times
    larger, the bias bank `scale` times, the output projection `output` times, so that the attention's keys (from
    the short convolutions inside it) and its bias (distances, extent) show in the tokens."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "rel_logits_proj"):
                module.q_norm.weight.mul_(sharpen)
                module.k_norm.weight.mul_(sharpen)
                module.rel_logits_proj.proj.mul_(scale)
                module.o_proj.weight.mul_(output)


def strong_state(model, scale=4.0):
    """A tiny random Mamba-1 barely uses its recurrent state (its B and C are so small that dropping the state
    between the pieces of a prompt moves logits by ~0.1): B and C `scale` times larger, so that it shows in the tokens
    (falcon_mamba normalizes them: no change)."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "x_proj") and hasattr(module, "time_step_rank"):
                module.x_proj.weight[module.time_step_rank:] *= scale


def prompts(lengths=(5, 11, 17, 9), seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def run(model, prompt_list, params, **options):
    llm = hf_paged.LLM(model, **{"num_blocks": 64, "block_size": 4, **options})
    outs = llm.generate(prompt_list, params, use_tqdm=False)
    llm.engine.check_idle()  # every block and every state slot back
    return [[list(c.token_ids) for c in o.outputs] for o in outs], llm.engine.stats()


GREEDY = hf_paged.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f not in NO_BATCH_REFERENCE])
def test_generate_takeover_matches_hf(models, engine_runs, model_type):
    """`generate(cache_implementation="paged")` on a left-padded batch of 3 prompts runs on the engine and gives
    HF's own greedy tokens."""
    model = models(model_type)
    ids, mask = left_padded_batch([5, 11, 17])
    assert_same_as_hf(model, ids, mask, max_new_tokens=12, do_sample=False)
    assert engine_runs, "the call did not run on the engine"


@pytest.mark.parametrize("model_type", PRESSED)
def test_pressure_gives_the_unpressured_tokens(models, model_type):
    """Chunked prefill with a budget smaller than a prompt, a pool so small that requests are preempted (their state
    rebuilt from their tokens), priorities: the same tokens as a roomy engine, and as HF alone."""
    model = models(model_type)
    batch = prompts()
    roomy, _ = run(model, batch, GREEDY)
    alone = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in batch]
    assert [r[0] for r in roomy] == alone
    pressed, stats = run(model, batch, GREEDY, num_blocks=10, max_num_batched_tokens=6, long_prefill_token_threshold=4,
                         max_num_seqs=3, preemption_mode="recompute")
    assert pressed == roomy
    assert stats["num_preemptions"] > 0 and stats["num_recomputed_tokens"] > 0


@pytest.mark.parametrize("model_type", ("qwen3_5_text", "falcon_h1", "minimax", "inkling_text", "recurrent_gemma"))
def test_swap_saves_the_state(models, model_type):
    """Preempted by swap: the blocks and the state go to host memory and come back; the same tokens."""
    model = models(model_type)
    batch = prompts()
    roomy, _ = run(model, batch, GREEDY)
    swapped, stats = run(model, batch, GREEDY, num_blocks=10, max_num_seqs=3, preemption_mode="swap",
                         swap_space=1 << 20)
    assert swapped == roomy
    assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] > 0 and stats["num_recomputed_tokens"] == 0


@pytest.mark.parametrize("model_type", ("qwen3_5_text", "mamba2", "minimax", "inkling_text", "recurrent_gemma", "rwkv"))
def test_n_samples_fork_the_state(models, model_type):
    """n=3 seeded samples fork from one computed prompt (the state copied to each sample's slot): each sample equals
    the same seeded request run alone."""
    model = models(model_type)
    batch = prompts((7, 13))
    params = hf_paged.SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    together, _ = run(model, batch, params)
    for prompt, samples in zip(batch, together):
        for k in range(3):
            one = hf_paged.SamplingParams(max_tokens=8, temperature=1.0, seed=5 + k, ignore_eos=True)
            alone, _ = run(model, [prompt], one)
            assert samples[k] == alone[0][0]


def test_abort_mid_way_leaves_the_others_exact(models):
    model = models("qwen3_5_text")
    batch = prompts()
    want, _ = run(model, batch, GREEDY)
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    ids = [f"r{i}" for i in range(len(batch))]
    for request_id, prompt in zip(ids, batch):
        llm.engine.add_request(prompt, GREEDY, request_id=request_id)
    for _ in range(4):
        llm.engine.step()
    llm.engine.abort("r1")
    while llm.engine.has_unfinished:
        llm.engine.step()
    for i, request_id in enumerate(ids):
        if i != 1:
            assert list(llm.engine.parents[request_id].samples[0].output_token_ids) == want[i][0]
    assert llm.engine.scheduler.kv.states.num_used == 0


def test_failed_step_changes_nothing(models, monkeypatch):
    """A forward pass that fails after the state layers wrote their slots: the step is undone and the requests whose
    state it may have written are recomputed; the tokens equal an undisturbed run."""
    model = models("qwen3_5_text")
    batch = prompts()
    want, _ = run(model, batch, GREEDY)
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    for i, prompt in enumerate(batch):
        llm.engine.add_request(prompt, GREEDY, request_id=str(i))
    original, calls = ModelRunner.forward, []

    def failing(self, *args, **kwargs):
        out = original(self, *args, **kwargs)  # every state slot of the step is written
        calls.append(1)
        if len(calls) in (3, 6):
            raise RuntimeError("injected")
        return out

    monkeypatch.setattr(ModelRunner, "forward", failing)
    failures = 0
    while llm.engine.has_unfinished:
        try:
            llm.engine.step()
        except RuntimeError:
            failures += 1
    assert failures == 2
    assert [list(llm.engine.parents[str(i)].samples[0].output_token_ids) for i in range(len(batch))] == \
        [w[0] for w in want]


def test_state_memory_is_its_own(models):
    """A hybrid's KV pages hold only its attention layers; a pure state-space model holds no K/V pages at all."""
    hybrid = hf_paged.LLM(models("qwen3_5_text"), num_blocks=16, block_size=4).engine
    assert hybrid.spec.kv.attention_layers == (3,)
    assert hybrid.memory.cache.storage.shape[0] == 1
    assert [k is None for k in hybrid.memory.cache.key_caches] == [True, True, True, False]
    ssm = hf_paged.LLM(models("mamba2"), block_size=4).engine
    assert ssm.memory.cache.storage.numel() == 0 and ssm.spec.kv.attention_layers == ()


def shared_prefix_batch(prefix_len=24, suffixes=(3, 5, 2, 6), seed=4):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (prefix_len,), generator=gen).tolist()
    return [shared + torch.randint(3, 256, (n,), generator=gen).tolist() for n in suffixes]


@pytest.mark.parametrize("model_type", ("qwen3_5_text", "mamba2", "falcon_h1", "mamba", "falcon_mamba", "minimax",
                                        "inkling_text", "recurrent_gemma", "rwkv"))
def test_prefix_hits_restore_the_state(models, model_type):
    """Prompts sharing 24 tokens (6 blocks of 4): the state after every 2nd block and after each prompt's last full
    block is checkpointed; later prompts start from the checkpoint at the hit point. Same tokens as without prefix
    caching (which equal HF's alone)."""
    model = models(model_type)
    batch = shared_prefix_batch()
    plain, _ = run(model, batch, GREEDY, enable_prefix_caching=False)
    cached, stats = run(model, batch, GREEDY, state_checkpoint_interval=2)
    assert cached == plain
    assert stats["prefix_cache_hit_tokens"] >= 3 * 24
    again, stats = run(model, batch + batch, GREEDY, state_checkpoint_interval=2)  # whole prompts repeated
    assert again == plain + plain


def test_checkpoint_store_evicts_and_stays_exact(models):
    """One checkpoint for many prefixes: the least recently used goes, hits shrink, tokens stay the same; no
    checkpoints at all: no hits."""
    model = models("qwen3_5_text")
    batch = shared_prefix_batch(seed=5) + shared_prefix_batch(seed=6)
    plain, _ = run(model, batch, GREEDY, enable_prefix_caching=False)
    small, stats = run(model, batch, GREEDY, state_checkpoints=1, state_checkpoint_interval=1)
    assert small == plain and stats["prefix_cache_hit_tokens"] > 0
    none, stats = run(model, batch, GREEDY, state_checkpoints=0)
    assert none == plain and stats["prefix_cache_hit_tokens"] == 0


def test_failed_step_drops_the_checkpoints_it_wrote(models, monkeypatch):
    """A step that wrote checkpoints fails: they leave the store (their contents are unknown); the tokens equal an
    undisturbed run."""
    model = models("qwen3_5_text")
    batch = shared_prefix_batch()
    plain, _ = run(model, batch, GREEDY, enable_prefix_caching=False)
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4, state_checkpoint_interval=1, max_num_seqs=1)
    for i, prompt in enumerate(batch):
        llm.engine.add_request(prompt, GREEDY, request_id=str(i))
    original, failed = StateView.write_back, []

    def failing(self, checkpoints=None):
        # half-way through a forward that writes checkpoints: layers 0 and 1 wrote theirs, layer 2 fails
        if self.run.checkpoint is not None and self.layer == 2 and len(failed) < 2:
            failed.append(1)
            raise RuntimeError("injected")
        return original(self, checkpoints)

    monkeypatch.setattr(StateView, "write_back", failing)
    while llm.engine.has_unfinished:
        try:
            llm.engine.step()
        except RuntimeError:
            assert not llm.engine.scheduler.kv.checkpoints.keys  # nothing else was kept before the failures
    assert failed == [1, 1]
    assert [list(llm.engine.parents[str(i)].samples[0].output_token_ids) for i in range(len(batch))] == \
        [p[0] for p in plain]
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("model_type", ("qwen3_5_text", "mamba2"))
def test_returned_cache_continues_like_hf(models, model_type):
    """`return_dict_in_generate=True` returns a cache holding each row's state (and its attention K/V): a second
    generate on it continues exactly as HF's own cache does."""
    model = models(model_type)
    ids, mask = left_padded_batch([5, 11, 17])
    options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(ids, attention_mask=mask, **options)
    out = model.generate(ids, attention_mask=mask, cache_implementation="paged", **options)
    assert torch.equal(out.sequences, ref.sequences)
    longer = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], 1)
    want = model.generate(ref.sequences, attention_mask=longer, cache=ref.past_key_values, max_new_tokens=5,
                          do_sample=False)
    got = model.generate(out.sequences, attention_mask=longer, cache=out.past_key_values, max_new_tokens=5,
                         do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("model_type", ("qwen3_5_text", "falcon_h1"))
def test_right_padding_runs_hf_loop_with_hf_tokens(models, model_type):
    """HF's right-padded batch feeds the padding through the state layers (their state changes over it): such a
    call runs HF's own loop on a PagedCache, and gives HF's tokens."""
    model = models(model_type)
    gen = torch.Generator().manual_seed(3)
    ids, mask = torch.zeros(3, 9, dtype=torch.long), torch.zeros(3, 9, dtype=torch.long)
    for row, length in enumerate((5, 9, 7)):
        ids[row, :length] = torch.randint(3, 256, (length,), generator=gen)
        mask[row, :length] = 1
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="paged")
    assert torch.equal(got, want)


def test_a_model_on_a_cache_of_its_own_is_refused_hfs_loop(models):
    """minimax's forward accepts only its own MiniMaxCache: a call that needs HF's own loop (beams) cannot run it on a
    PagedCache, and says so."""
    ids, mask = left_padded_batch([5, 11])
    with pytest.raises(ValueError, match="'minimax': generation mode 'beam_search'.*only its own cache class Mini"):
        models("minimax").generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=3,
                                   cache_implementation="paged")


@pytest.mark.parametrize("model_type", ("mamba2", "falcon_h1"))
def test_prompts_starting_together_run_as_hfs_padded_batch(model_type):
    """Prompts that start in the same step run through the state modules as one left-padded batch with HF's 2D
    mask: with non-zero convolution biases the padding would otherwise leak into the state."""
    model = tiny_hybrid(model_type)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Conv1d) and module.bias is not None:
                module.bias.normal_(0, 1.0)
    ids, mask = left_padded_batch([5, 11, 17])
    assert_same_as_hf(model, ids, mask, max_new_tokens=8, do_sample=False)


def test_a_prompt_ending_in_a_one_token_chunk_writes_its_checkpoint(models):
    """The last chunk of a prompt is one token that ends a checkpointed block: it runs as its own piece (not in the
    batched decode call), so the checkpoint is written; a later prompt hitting that block gets the right state."""
    model = models("qwen3_5_text")
    shared = prompts((8,), seed=7)[0]
    longer = shared + [11, 12, 13, 14]
    want, _ = run(model, [longer], GREEDY, enable_prefix_caching=False)
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4, state_checkpoint_interval=1, long_prefill_token_threshold=7)
    llm.generate([shared], GREEDY, use_tqdm=False)  # chunks of 7 and 1 tokens: the 1-token chunk ends block 2
    got = llm.generate([longer], GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] == 8
    assert [list(got[0].outputs[0].token_ids)] == want[0]


@pytest.mark.parametrize("span", (state_layers.KEEP_SPAN, 3))
@pytest.mark.parametrize("model_type", ("mamba", "falcon_mamba"))
def test_mamba_1_chunked_prefill_gives_hfs_tokens(models, model_type, span, monkeypatch):
    """A 40-token prompt computed in chunks of 8 (each chunk continues the state of the ones before), also with a
    chunk's continuation run in calls of at most 3 tokens (`KEEP_SPAN`): HF's tokens."""
    monkeypatch.setattr(state_layers, "KEEP_SPAN", span)
    model = models(model_type)
    prompt = prompts((40,), seed=3)[0]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, 40:].tolist()
    got, _ = run(model, [prompt], GREEDY, max_num_batched_tokens=8)
    assert got == [[want]]


@pytest.mark.parametrize("model_type", ("mamba", "qwen3_5_text"))
def test_token_by_token_continuations_are_exact(models, model_type, monkeypatch):
    """The fallback mode (a continuation as one call per token, for a module exact in no cheaper mode) under
    chunked prefill, preemption by recompute and prefix hits: the tokens of the modes chosen by the check."""
    model = models(model_type)
    batch = shared_prefix_batch(prefix_len=12)
    options = dict(num_blocks=12, max_num_batched_tokens=6, long_prefill_token_threshold=4, max_num_seqs=3,
                   preemption_mode="recompute", state_checkpoint_interval=1)
    want, _ = run(model, batch, GREEDY, **options)
    monkeypatch.setattr(model_spec, "continuation_modes", lambda model, state: dict.fromkeys(state, TOKEN_BY_TOKEN))
    got, stats = run(model, batch, GREEDY, **options)
    assert got == want
    assert stats["num_recomputed_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0
