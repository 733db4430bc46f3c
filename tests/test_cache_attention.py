"""The "paged_cache" attention: HF's own loop on a PagedCache reads the pages in place (no gathered copy) for sdpa
models, with exactly DynamicCache's results; other models keep the gathered copy; the model is left as found; other
threads meanwhile get plain sdpa."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from hf_paged import PagedCache
from hf_paged.kv import PagedStore
from takeover_helpers import batch, model_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODES = {"greedy": dict(do_sample=False), "beam": dict(num_beams=3, num_return_sequences=2, do_sample=False),
         "sample": dict(do_sample=True, top_k=8)}


def padded_batch(seed: int):
    """Left padding, one row with a gap, prompts longer than mistral's window of 8."""
    ids, mask = batch((5, 13, 9), seed=seed)
    mask[2, 6:8] = 0
    return ids, mask


def generate(model, ids, mask, **kwargs):
    torch.manual_seed(0)
    return model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True, **kwargs)


@pytest.fixture
def no_gathering(monkeypatch):
    """Gathering a layer's pages into a copy fails: what passes under it read the pages in place."""
    def refuse(self, layer, length):
        raise AssertionError("a gathered copy of the pages was made")

    monkeypatch.setattr(PagedStore, "read", refuse)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "qwen3"])
@pytest.mark.parametrize("mode", list(MODES))
def test_pages_are_read_in_place_with_dynamic_cache_results(arch, mode, request):
    model = model_for(arch)
    ids, mask = padded_batch(seed=21)
    ref = generate(model, ids, mask, **MODES[mode])
    request.getfixturevalue("no_gathering")
    for how in ({"cache": PagedCache(model.config, block_size=4)}, {"cache_implementation": "paged"}):
        out = generate(model, ids, mask, **MODES[mode], **how)
        assert torch.equal(out.sequences, ref.sequences), how
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation == "sdpa"


def test_models_not_on_sdpa_keep_the_gathered_copy(no_gathering):
    """gemma2 runs eager attention (softcapping): HF's own attention reads the gathered copy, as before."""
    model = model_for("gemma2")
    ids, mask = padded_batch(seed=22)
    with pytest.raises(AssertionError, match="gathered copy"):
        generate(model, ids, mask, cache=PagedCache(model.config))
    assert model.config._attn_implementation == "eager"


def test_the_model_is_restored_when_the_call_raises():
    model = model_for("llama")
    ids, mask = padded_batch(seed=23)

    def explode(input_ids, scores):
        if input_ids.shape[1] > ids.shape[1] + 2:
            raise RuntimeError("boom")
        return scores

    with pytest.raises(RuntimeError, match="boom"):
        generate(model, ids, mask, cache=PagedCache(model.config), logits_processor=[explode])
    assert model.config._attn_implementation == "sdpa"
    lock = model.__dict__["_hf_paged_forward_lock"]
    assert lock.acquire(blocking=False)  # released (an RLock: taking it from another thread proves it is free)
    lock.release()


def test_other_threads_get_plain_sdpa_meanwhile():
    """While one call reads pages in place (the model switched to "paged_cache"), another thread's ordinary generate
    on the same model (DynamicCache) gets exactly its own results."""
    model = model_for("llama")
    ids, mask = padded_batch(seed=24)
    other_ids, other_mask = batch((7, 3), seed=25)
    expected = generate(model, other_ids, other_mask).sequences
    long_call = threading.Thread(target=lambda: model.generate(ids, attention_mask=mask, max_new_tokens=60,
                                                               num_beams=4, cache=PagedCache(model.config)))
    long_call.start()
    results = []
    while long_call.is_alive() or not results:
        results.append(generate(model, other_ids, other_mask).sequences)
    long_call.join()
    assert all(torch.equal(r, expected) for r in results), len(results)


def test_own_forward_loop_with_the_paged_cache_attention(no_gathering):
    """A user's own loop: `set_attn_implementation("paged_cache")`, a PagedCache, padding: the logits of sdpa on a
    DynamicCache, no gathered copy."""
    model = model_for("mistral")
    ids, mask = padded_batch(seed=26)
    steps = torch.randint(3, 200, (ids.shape[0], 12), generator=torch.Generator().manual_seed(1))

    def run(cache):
        logits, full_mask = [], mask
        with torch.no_grad():
            logits.append(model(ids, attention_mask=full_mask, cache=cache, use_cache=True).logits[:, -1])
            for t in range(steps.shape[1]):
                full_mask = torch.cat([full_mask, torch.ones_like(full_mask[:, :1])], dim=1)
                logits.append(model(steps[:, t:t + 1], attention_mask=full_mask, cache=cache,
                                    use_cache=True).logits[:, -1])
        return torch.stack(logits)

    ref = run(DynamicCache(config=model.config))
    model.set_attn_implementation("paged_cache")
    try:
        out = run(PagedCache(model.config, block_size=4))
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_hf_loop_calls_never_meet_an_engine_forward():
    """An engine serving the same model from another thread switches its attention to "paged" for each of its
    forwards; a call in HF's own loop (gemma2: eager, gathered copies) holds the model's forward lock and so never
    runs a forward while it is switched."""
    import hf_paged

    model = model_for("gemma2")
    ids, mask = padded_batch(seed=27)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, num_beams=2, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, cache=PagedCache(model.config), **kwargs)
    llm = hf_paged.LLM(model, block_size=4)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            llm.generate([[5, 6, 7, 8, 9]] * 3, hf_paged.SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)

    server = threading.Thread(target=serve)
    server.start()
    try:
        outs = [model.generate(ids, cache_implementation="paged", **kwargs) for _ in range(6)]
    finally:
        stop.set()
        server.join()
    assert all(torch.equal(out, expected) for out in outs)
