"""State modules that keep their state outside transformers' cache calls (model/own_state.py): recurrent_gemma's
recurrent blocks on themselves, rwkv's blocks in the state list its forward passes down. Both are served from the
engine's state slots through a bridge; recurrent_gemma's local attention is an ordinary paged sliding-window layer.
(tests/test_hybrid_engine.py runs both through its parametrized tests: HF's tokens, pressure, prefix hits, n
samples, continuation modes.)"""
from __future__ import annotations

import logging

import pytest
import torch

import hf_paged
import hf_paged.model.own_state as own_state
import hf_paged.model.spec as model_spec
from hf_paged.model.state_layers import AS_IS
from hf_paged.tiny import tiny_hybrid

from conftest import left_padded_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = hf_paged.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(model_type):
        if model_type not in built:
            built[model_type] = tiny_hybrid(model_type)
        return built[model_type]
    return get


def prompts(lengths=(5, 11, 17, 9), seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def hf_alone(model, prompt, new=12):
    return model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()


def test_rwkv_serves_each_prompt_as_hf_does_alone(models, engine_runs, caplog):
    """rwkv takes no attention mask (a padded row's padding runs through its state) and transformers' batched
    single-token step mixes sequences, so HF's own padded batch is no reference: the engine gives each of 4 prompts of
    different lengths, run together, HF's tokens for it alone; a padded `generate` runs HF's own loop (saying so) and
    gives HF's tokens; an unpadded one runs on the engine."""
    model = models("rwkv")
    batch = prompts()
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_alone(model, p) for p in batch]
    ids, mask = left_padded_batch([5, 11, 17])
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="paged")
    assert "feeds it through its state" in caplog.text and not engine_runs
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    one = ids[2:]
    assert torch.equal(model.generate(one, max_new_tokens=6, do_sample=False, cache_implementation="paged"),
                       model.generate(one, max_new_tokens=6, do_sample=False))
    assert engine_runs


def test_rwkv_starts_from_the_models_own_initial_state(models):
    """A sequence starting from no state gets the entries of the state list rwkv's own forward makes for a new batch
    (zeros, its running maximum at -1e30), recorded from that forward: what its block sees before any block wrote."""
    model = models("rwkv")
    own_state.own_state_modules(model)
    block, seen = model.rwkv.blocks[2], []
    hook = block.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        [t[..., 2].clone() for t in kwargs["state"]]), with_kwargs=True)
    try:
        model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)  # blocks 0 and 1 write only their own entries
    finally:
        hook.remove()
    initial, layers = own_state._initial(block)
    assert layers == 4 and len(initial) == len(seen[0]) == 5
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(initial, seen[0]))
    assert float(initial[4].max()) == pytest.approx(-1e30)


def test_rwkv_batched_single_tokens_run_one_sequence_per_call(models, monkeypatch):
    """Left to run a batch of single tokens in one call of its own code, rwkv mixes the sequences: the start-up check
    refuses it rather than serve it wrong."""
    model = tiny_hybrid("rwkv")
    monkeypatch.setitem(own_state.OWN_STATE, "RwkvBlock", own_state.PassedIn("state"))
    with pytest.raises(ValueError, match="'rwkv': hf_paged's paged attention does not reproduce"):
        hf_paged.LLM(model)


def test_recurrent_gemma_attention_lives_in_paged_sliding_blocks(models):
    """Its local attention layer (window 16) keeps K/V in the engine's pages as a sliding-window group that gives
    back the blocks behind its window; its recurrent blocks keep no K/V, only state slots."""
    model = models("recurrent_gemma")
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    engine = llm.engine
    assert engine.spec.kv.attention_layers == (2,)
    assert sorted(engine.spec.state_layers.values()) == [0, 1, 3]
    assert [k is None for k in engine.memory.cache.key_caches] == [True, True, False, True]
    assert [(g.layers, g.window) for g in engine.spec.kv.kv_groups] == [((2,), 16)]
    long = prompts((30, 7), seed=2)
    outs = llm.generate(long, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_alone(model, p) for p in long]
    assert llm.stats()["num_blocks_released"] > 0


def test_bridges_leave_the_modules_as_found(models):
    """The state a recurrent_gemma block holds on itself is the caller's before and after an engine run."""
    model = models("recurrent_gemma")
    block = model.model.layers[0].temporal_block
    mine = (torch.full((1, 64, 3), 5.0), torch.full((1, 64), 6.0))
    block.conv1d_state, block.rg_lru.recurrent_states = mine
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    llm.generate(prompts((6, 9)), GREEDY, use_tqdm=False)
    assert block.conv1d_state is mine[0] and block.rg_lru.recurrent_states is mine[1]


def test_recurrent_gemma_continuing_as_is_is_refused(monkeypatch):
    """Its own multi-token path starts the convolution from zeros: run as it is, a continuation drops the previous
    convolution window, which the start-up check catches."""
    monkeypatch.setattr(model_spec, "continuation_modes", lambda model, state: dict.fromkeys(state, AS_IS))
    with pytest.raises(ValueError, match="'recurrent_gemma': hf_paged's paged attention does not reproduce"):
        hf_paged.LLM(tiny_hybrid("recurrent_gemma"))


@pytest.mark.parametrize("model_type", ("recurrent_gemma", "rwkv"))
def test_generate_returns_no_cache_for_state_held_outside_it(models, model_type):
    """No cache of HF's holds such a model's state (HF's loop reads it from the modules or its own argument): a
    returned cache could not be continued from, so `return_dict_in_generate` returns none; the tokens are HF's."""
    model = models(model_type)
    ids = torch.tensor([prompts((9,), seed=5)[0]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                         cache_implementation="paged")
    assert out.past_key_values is None
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=5, do_sample=False))
