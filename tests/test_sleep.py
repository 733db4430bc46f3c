"""`LLM.sleep()` / `wake_up()` (engine/engine.py, engine/memory.py, kv/cache.py): between RL rollouts the KV pool's
memory goes back and comes again; nothing computed before is read after (no stale prefix hits, no stale state), the
tokens stay HF's, and an engine with work refuses to sleep."""
from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.tiny import tiny_hybrid, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = hf_paged.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompts(seed=0, lengths=(21, 9, 30)):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 200, (16,), generator=gen).tolist()
    return [shared + torch.randint(3, 200, (n,), generator=gen).tolist() for n in lengths]


def hf(model, batch):
    return [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in batch]


@pytest.mark.parametrize("build", [lambda: tiny_model("llama"), lambda: tiny_hybrid("qwen3_5_text")],
                         ids=["llama", "qwen3_5_text"])
def test_sleep_gives_the_pool_back_and_wakes_exact(build):
    model = build()
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    batch = prompts()
    first = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    assert first == hf(model, batch)
    full = llm.stats()["kv_cache_bytes"]
    llm.sleep()
    assert llm.engine.asleep and llm.stats()["kv_cache_bytes"] == 0 < full
    states = llm.engine.scheduler.kv.states
    assert states is None or states.num_bytes == 0
    with torch.no_grad():  # the weights change while asleep (an optimizer step)
        model.get_output_embeddings().weight.mul_(1.5)
    again = llm.generate(batch, GREEDY, use_tqdm=False)  # wakes by itself
    assert not llm.engine.asleep and llm.stats()["kv_cache_bytes"] == full
    assert [o.outputs[0].token_ids for o in again] == hf(model, batch)
    llm.engine.check_idle()


def test_hits_after_waking_come_only_from_what_was_computed_after():
    """The memory comes back with garbage in it: a prefix hit on a block computed before sleeping would read it."""
    model = tiny_model("llama")
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
    batch = prompts(seed=1)
    llm.generate(batch[:1], GREEDY, use_tqdm=False)
    llm.sleep()
    llm.wake_up()
    llm.engine.memory.cache.storage.normal_()  # what freed memory may hold
    llm.engine.memory.cache.storage[:, :, 0].zero_()  # (the null block is zeroed on waking)
    before = llm.stats()["prefix_cache_hit_tokens"]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf(model, batch)
    assert llm.stats()["prefix_cache_hit_tokens"] > before  # the later prompts still share the first one's blocks


def test_an_engine_with_work_refuses_to_sleep():
    llm = hf_paged.LLM(tiny_model("llama"), num_blocks=64, block_size=4)
    request_id = llm.add_request(prompts()[0], GREEDY)
    llm.step()
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.sleep()
    assert not llm.engine.asleep
    llm.abort(request_id)
    llm.sleep()
    assert llm.engine.asleep
