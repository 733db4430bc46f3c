"""Cached K/V is keyed by everything that produced it: a persistent LLM never serves a prefix computed before the
model's weights, buffers or adapters changed (optimizer steps, load_state_dict, adapter switches), and
`reset_prefix_cache` covers what it cannot see."""
import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.tiny import tiny_model

SYSTEM = list(range(30, 62))  # a shared "system prompt": four full blocks of 8
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts(k):
    return [SYSTEM + [70 + k, 71 + k], SYSTEM + [90 + k]]


def fresh_tokens(model, batch):
    """What an engine that never saw the old weights gives."""
    return [o.token_ids for o in LLM(model, block_size=8).generate(batch, PARAMS, use_tqdm=False)]


@pytest.fixture
def model():
    return tiny_model("llama", seed=3)


def serve(llm, batch):
    outs = llm.generate(batch, PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_an_optimizer_step_invalidates_cached_prefixes(model):
    llm = LLM(model, block_size=8)
    serve(llm, prompts(0))
    _, cached = serve(llm, prompts(1))
    assert cached[0] == 32, "the shared prefix was not reused before the change: the test tests nothing"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.tensor([SYSTEM + [5, 6]])
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    tokens, cached = serve(llm, prompts(2))
    assert tokens == fresh_tokens(model, prompts(2))
    assert cached[0] == 0
    _, cached = serve(llm, prompts(3))
    assert cached[0] == 32  # reuse resumes under the new weights


def test_load_state_dict_invalidates_cached_prefixes(model):
    other = tiny_model("llama", seed=4)
    llm = LLM(model, block_size=8)
    serve(llm, prompts(0))
    model.load_state_dict(other.state_dict())
    tokens, cached = serve(llm, prompts(1))
    assert tokens == fresh_tokens(other, prompts(1)) and cached[0] == 0


class SwitchableAdapter(torch.nn.Module):
    """Stands in for a PEFT LoRA layer: a base linear plus a delta, off while `_disable_adapters` is set."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base_layer = base
        self.delta = torch.nn.Linear(base.in_features, base.out_features, bias=False)
        torch.nn.init.normal_(self.delta.weight, std=0.5)
        self._disable_adapters = False

    def forward(self, x):
        out = self.base_layer(x)
        return out if self._disable_adapters else out + self.delta(x)


def test_switching_an_adapter_off_invalidates_cached_prefixes(model):
    layer = model.model.layers[0].mlp
    layer.down_proj = SwitchableAdapter(layer.down_proj)
    llm = LLM(model, block_size=8)
    with_adapter = serve(llm, prompts(0))[0]
    layer.down_proj._disable_adapters = True
    tokens, cached = serve(llm, prompts(0))
    assert cached[0] == 0 and tokens == fresh_tokens(model, prompts(0))
    assert tokens != with_adapter, "the adapter changes nothing: the test tests nothing"
    layer.down_proj._disable_adapters = False
    tokens, cached = serve(llm, prompts(0))
    assert cached[0] == 0 and tokens == with_adapter


def test_reset_prefix_cache_covers_writes_it_cannot_see(model):
    llm = LLM(model, block_size=8)
    serve(llm, prompts(0))
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.data.mul_(-1.0)  # through .data: no version bump
    llm.reset_prefix_cache()
    tokens, cached = serve(llm, prompts(1))
    assert cached[0] == 0 and tokens == fresh_tokens(model, prompts(1))
    llm.engine.check_idle()


def test_a_request_queued_before_the_change_uses_the_new_weights(model):
    """Block keys computed while a request waited (under the old weights) are dropped with the change."""
    llm = LLM(model, block_size=8, max_num_seqs=1)
    serve(llm, prompts(0))
    ids = [llm.add_request(p, PARAMS) for p in prompts(1)]
    llm.step()  # the first is admitted (a prefix hit), the second waits with its keys computed
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.num_cached_tokens)
    assert done[ids[1]][0] == fresh_tokens(model, [prompts(1)[1]])[0]


def test_a_module_swapped_in_after_serving_invalidates_cached_prefixes(model):
    """PEFT injects its layers with setattr after the model may have served: the registration is seen."""
    llm = LLM(model, block_size=8)
    plain = serve(llm, prompts(0))[0]
    _, cached = serve(llm, prompts(0))
    assert cached[0] == 32
    layer = model.model.layers[0].mlp
    layer.down_proj = SwitchableAdapter(layer.down_proj)
    tokens, cached = serve(llm, prompts(0))
    assert cached[0] == 0 and tokens == fresh_tokens(model, prompts(0)) and tokens != plain


def test_a_forward_registering_temporary_modules_keeps_the_cache(model):
    """transformers' forward slices its ModuleList of layers (a new ModuleList, registrations on it): that is not
    a change of the model, so prefixes stay cached."""
    llm = LLM(model, block_size=8)
    serve(llm, prompts(0))
    model(torch.tensor([[1, 2, 3]]))
    _, cached = serve(llm, prompts(1))
    assert cached[0] == 32


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_a_request_running_across_a_change_publishes_nothing(model):
    """Found by review: a request whose first block was partly computed under the old weights published it under the
    new context's key when it filled up (its keys were computed lazily, after the change)."""
    llm = LLM(model, block_size=8, attention_backend="torch")
    llm.add_request([5, 6, 7], greedy(12), request_id="A")
    for _ in range(3):
        llm.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    ended = {}
    while llm.has_unfinished_requests():
        ended.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
    probe = ([5, 6, 7] + ended["A"])[:8] + [40, 41, 42]
    got = llm.generate([probe], greedy(8), use_tqdm=False)[0]
    assert got.num_cached_tokens == 0 and got.token_ids == fresh_tokens(model, [probe])[0]


def test_an_interrupted_context_change_is_finished_by_the_next_step(model, monkeypatch):
    """Found by review: the new context was recorded before the old blocks left the prefix map; a Ctrl-C in between
    was never retried."""
    from hf_paged.kv.block_pool import BlockPool

    system = list(range(30, 38))
    llm = LLM(model, block_size=4, num_blocks=8, attention_backend="torch")
    llm.generate([system + [1]], greedy(1), use_tqdm=False)
    llm.add_request(list(range(60, 78)), greedy(3), request_id="R")
    waiting = system + [2, 3, 4, 5, 6, 7]
    llm.add_request(waiting, greedy(6), request_id="W")
    llm.step()
    assert llm.engine.scheduler.waiting and llm.engine.scheduler.waiting[0].block_hashes
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    original, calls = BlockPool.uncache, [0]

    def uncache(self, block_id):
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return original(self, block_id)

    monkeypatch.setattr(BlockPool, "uncache", uncache)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    monkeypatch.undo()
    ended = {}
    while llm.has_unfinished_requests():
        ended.update({o.request_id: (o.token_ids, o.num_cached_tokens) for o in llm.step() if o.finished})
    fresh = LLM(model, block_size=4, attention_backend="torch").generate([waiting], greedy(6), use_tqdm=False)[0]
    assert ended["W"] == (fresh.token_ids, 0)


def test_a_stale_request_under_a_sliding_window_still_gives_blocks_back():
    """Found by review: a request running across a change never published again, and the window's release (capped at
    its published blocks) stopped: its blocks grew without bound."""
    from hf_paged.kv.manager import held

    mistral = tiny_model("mistral", seed=3)
    llm = LLM(mistral, block_size=4, attention_backend="torch")
    assert llm.engine.scheduler.release_window
    llm.add_request([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                    request_id="A")
    llm.step()
    llm.step()
    with torch.no_grad():
        for p in mistral.parameters():
            p.mul_(1.01)
    most = 0
    while llm.has_unfinished_requests():
        llm.step()
        group = llm.engine.parents.get("A")
        if group is not None:
            most = max(most, len(held(group.samples[0].block_table)))
    assert most <= 3


def test_a_stale_request_recomputed_publishes_findable_blocks(model):
    """Found by review: recomputed after a change, a request kept its keys from the old root, so what it then
    published (correct K/V) could never be found."""
    llm = LLM(model, block_size=4, attention_backend="torch")
    scheduler = llm.engine.scheduler
    prompt = list(range(10, 23))
    llm.add_request(prompt, greedy(3), request_id="A")
    llm.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    llm.step()
    with llm.engine.lock:
        scheduler.recompute(scheduler.running[0])
    while llm.has_unfinished_requests():
        llm.step()
    got = llm.generate([prompt + [99]], greedy(2), use_tqdm=False)[0]
    assert got.num_cached_tokens == 12
    assert got.token_ids == LLM(model, block_size=4).generate([prompt + [99]], greedy(2), use_tqdm=False)[0].token_ids


def test_the_registration_hooks_accept_unhashable_modules(model):
    """Found by review: the fingerprint's global hooks kept modules in a WeakSet, so after hf_paged ran, building any
    module whose class defines __eq__ without __hash__ raised TypeError, anywhere in the process."""

    class Unhashable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def __eq__(self, other):
            return self is other

    serve(LLM(model, block_size=8), prompts(0))
    Unhashable()
