"""Right padding on the engine. HF samples a right-padded row's first new token from its last pad (a query at the
position HF gave that pad, attending to the real tokens only) and numbers the next tokens on from that position.
The engine runs that pad as a query-only token (its K/V go nowhere) and shifts the positions of the outputs; these
tests compare with HF token for token and check that the call ran on the engine."""
from __future__ import annotations

import pytest
import torch

from hf_paged import SamplingParams
from hf_paged.engine import Engine
from hf_paged.tiny import tiny_model

from takeover_helpers import PAD, batch, model_for, on_engine, paged


def lower_triangular_mask(ids: torch.Tensor) -> torch.Tensor:
    """The masks transformers' generation tests build: lower-triangular, so row b has b + 1 real tokens and the
    rest is right padding."""
    return torch.tril(torch.ones_like(ids))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_right_padding_greedy_and_sampled(arch, engine_runs):
    model = model_for(arch)
    ids, mask = batch((3, 9, 1, 6), seed=21, side="right")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=10, do_sample=False), ref)
    if arch != "llama":
        return
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=2,
                  return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(3)
    ref = model.generate(ids, **kwargs)
    torch.manual_seed(3)
    out = paged(model, engine_runs, ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_testers_masks_and_gaps(engine_runs):
    """Lower-triangular masks (one real token in the first row), and a row with both a gap and right padding."""
    model = model_for()
    ids = batch((7, 7, 7, 7), seed=22)[0]
    mask = lower_triangular_mask(ids)
    mask[3] = torch.tensor([1, 0, 1, 1, 0, 1, 0])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    assert torch.equal(paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=9, do_sample=False), ref)


def test_hf_default_position_ids_passed_by_the_caller_stay_on_the_engine(engine_runs):
    model = model_for()
    ids, mask = batch((4, 8), seed=23, side="right")
    positions = model._prepare_position_ids_for_generation(ids, {"attention_mask": mask})
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    out = paged(model, engine_runs, ids, attention_mask=mask, position_ids=positions, max_new_tokens=6,
                do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("cache_config", [
    {"block_size": 4, "num_blocks": 9},  # too small a pool: rows are preempted (some before their first token)
    {"block_size": 4, "max_num_batched_tokens": 5},  # chunked prefill: the pad's query runs with the last chunk
], ids=["preemption", "chunked-prefill"])
def test_right_padding_under_preemption_and_chunking(cache_config, engine_runs):
    model = model_for()
    ids, mask = batch((3, 12, 7, 10), seed=24, side="right")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                cache_config=cache_config)
    assert torch.equal(out, ref)
    stats = engine_runs[-1].engine.stats()
    if "num_blocks" in cache_config:
        assert stats["num_preemptions"] > 0, stats


def test_shifted_outputs_are_never_reused_as_a_prefix():
    """A right-padded row's outputs sit at shifted positions: a later prompt made of the same tokens must not take
    their blocks from the prefix cache (it must get the tokens it gets on a fresh engine)."""
    model = model_for()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = batch((5,), seed=25)[0][0].tolist()
    engine = Engine(model, block_size=4, num_blocks=64, enable_prefix_caching=True)
    first = engine.add_request(prompt, params, first_query=(PAD, 0)).samples[0]
    while engine.has_unfinished:
        engine.step()
    follow_up = prompt + first.output_token_ids[:7]
    later = engine.add_request(follow_up, params).samples[0]
    while engine.has_unfinished:
        engine.step()
    assert later.output_token_ids == _run_alone(model, follow_up, params)
    assert engine.stats()["prefix_cache_hit_tokens"] == 0


def _run_alone(model, prompt, params) -> list[int]:
    engine = Engine(model, block_size=4, num_blocks=64)
    request = engine.add_request(prompt, params).samples[0]
    while engine.has_unfinished:
        engine.step()
    return request.output_token_ids


def test_padded_rows_with_equal_tokens_do_not_share_a_first_token(engine_runs):
    """num_return_sequences copies fork from one computed prompt; rows whose real tokens are equal but whose
    padding differs (left vs right) are not copies: each samples from its own query."""
    model = model_for()
    prompt = batch((5,), seed=26)[0][0]
    pads = torch.full((2,), PAD)
    ids = torch.stack([torch.cat([prompt, pads]), torch.cat([pads, prompt])])
    mask = (torch.arange(7) < 5).long().repeat(2, 1)
    mask[1] = mask[1].flip(0)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert not torch.equal(ref[0, 7:], ref[1, 7:]), "the two paddings gave the same tokens: the test shows nothing"
    assert torch.equal(paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=6, do_sample=False), ref)


def test_windows_longer_than_the_call_mask_nothing(engine_runs):
    """A sliding window at least as long as the input plus its new tokens hides no key, in HF's loop or on the
    engine: right padding on such a model runs on the engine."""
    model = tiny_model("mistral", sliding_window=64)
    ids, mask = batch((4, 9, 2), seed=27, side="right")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False), ref)


def test_eos_token_id_minus_one_means_none(engine_runs):
    """transformers' own tests pass eos_token_id=-1 for "never stop": a token id no row can produce."""
    model = model_for()
    ids, mask = batch((3, 7), seed=28)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=-1)
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=-1)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("side", ["left", "right"])
def test_token_type_ids_run_on_the_engine(side, engine_runs):
    """GPT-2 adds a token-type embedding: the engine hands each token its type (new tokens take the last column's,
    as HF does), also for samples forked from one prompt."""
    model = model_for("gpt2")
    ids, mask = batch((3, 8, 5), seed=29, side=side)
    types = torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=mask, token_type_ids=types, max_new_tokens=8, do_sample=True, top_k=20,
                  num_return_sequences=2)
    torch.manual_seed(5)
    ref = model.generate(ids, **kwargs)
    torch.manual_seed(5)
    without = model.generate(ids, **{**kwargs, "token_type_ids": None})
    assert not torch.equal(ref, without), "the types changed nothing: the test would show nothing"
    torch.manual_seed(5)
    assert torch.equal(paged(model, engine_runs, ids, **kwargs), ref)


def test_token_types_keep_prefix_blocks_apart():
    """Equal tokens with other types have other K/V: the prefix cache must not hand one request's blocks to the
    other."""
    model = model_for("gpt2")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = batch((9,), seed=30)[0][0].tolist()
    engine = Engine(model, block_size=4, num_blocks=64, enable_prefix_caching=True)
    for types in ([0] * 9, [1] * 9):
        engine.add_request(prompt, params, token_types=(types, types[-1]))
    while engine.has_unfinished:
        engine.step()
    second = engine.add_request(prompt, params, token_types=([2] * 9, 2)).samples[0]
    while engine.has_unfinished:
        engine.step()
    alone = Engine(model, block_size=4, num_blocks=64)
    reference = alone.add_request(prompt, params, token_types=([2] * 9, 2)).samples[0]
    while alone.has_unfinished:
        alone.step()
    assert second.output_token_ids == reference.output_token_ids
    assert engine.stats()["prefix_cache_hit_tokens"] == 0


def _run(engine: Engine, specs, params) -> list[list[int]]:
    requests = [engine.add_request(prompt, params, first_query=query, token_types=types).samples[0]
                for prompt, query, types in specs]
    while engine.has_unfinished:
        engine.step()
    engine.check_idle()
    return [r.output_token_ids for r in requests]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("typed", [False, True], ids=["untyped", "typed"])
def test_queries_and_types_under_pressure(mode, typed):
    """Requests with and without a first query (any position), with shared prefixes, token types or not, through a
    pool so small that they are chunked, preempted and swapped or recomputed (some before their first token): each
    gets exactly the tokens it gets alone, and the pool ends empty."""
    import random

    model = model_for("gpt2")
    rng = random.Random(7 + typed)
    shared = [rng.randrange(3, 256) for _ in range(16)]
    specs = []
    for _ in range(10):
        n = rng.randint(1, 16)
        prompt = shared[:n] if rng.random() < 0.5 else [rng.randrange(3, 256) for _ in range(n)]
        query = (rng.randrange(0, 256), rng.randrange(0, n + 1)) if rng.random() < 0.6 else None
        types = None
        if typed:
            row = [rng.choice([0, 0, 1]) for _ in range(n)]
            types = (row, rng.choice([0, 1]))
        specs.append((prompt, query, types))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tight = Engine(model, block_size=4, num_blocks=12, max_num_batched_tokens=16, preemption_mode=mode,
                   swap_space=1 << 20, enable_prefix_caching=True)
    got = _run(tight, specs, params)
    assert tight.stats()["num_preemptions"] > 0
    assert got == [_run(Engine(model, block_size=4, num_blocks=64), [spec], params)[0] for spec in specs]


# ---- what a review found: calls the engine must not take, and the cache after an early EOS ---------------------------
def _tiny(config_class, model_class, **sizes):
    torch.manual_seed(0)
    config = config_class(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes)
    model = model_class(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return _tiny(OPTConfig, OPTForCausalLM, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                 max_position_embeddings=512, word_embed_proj_dim=64)


def _gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    return _tiny(GPTNeoConfig, GPTNeoForCausalLM, hidden_size=64, num_layers=2, num_heads=4, window_size=4,
                 attention_types=[[["global", "local"], 1]], max_position_embeddings=256)


def _ctrl():
    from transformers import CTRLConfig, CTRLLMHeadModel

    return _tiny(CTRLConfig, CTRLLMHeadModel, n_embd=64, n_layer=2, n_head=4, dff=128)


@pytest.mark.parametrize("make, what", [
    (_opt, "right"),  # a learned position-embedding module: the engine feeds it sequence indices, not HF's positions
    (_gpt_neo, "right"),  # a local window (config.window_size) that HF counts over the padding columns
    (_ctrl, "types"),  # ctrl's own generate step drops token_type_ids: HF never feeds them to the model
], ids=["opt-right-padding", "gpt_neo-local-window", "ctrl-token-types"])
def test_calls_the_engine_cannot_reproduce_run_in_hf_loop(make, what, engine_runs):
    model = make()
    ids, mask = batch((7, 3), seed=31, side="right" if what == "right" else "left")
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    if what == "types":
        kwargs["token_type_ids"] = torch.zeros_like(ids)
    ref = model.generate(ids, **kwargs)
    with on_engine(engine_runs, model, expected=0):
        out = model.generate(ids, cache_implementation="paged", **kwargs)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("side", ["left", "right"])
def test_continuing_from_the_cache_after_an_early_eos(side, engine_runs):
    """HF's returned cache holds the K/V of the pads a finished row was fed; a continuation whose mask marks them
    real attends to them. The engine keeps finished rows running on pads when the cache is returned."""
    model = model_for()
    ids, mask = batch((1, 5, 3), seed=1, side=side)
    eos = int(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)[2, ids.shape[1] + 1])
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, eos_token_id=eos)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    out = paged(model, engine_runs, ids, attention_mask=mask, **kwargs)
    assert torch.equal(out.sequences, ref.sequences) and (ref.sequences[:, -1] == PAD).any()
    longer = torch.cat([mask, torch.ones(3, ref.sequences.shape[1] - ids.shape[1], dtype=torch.long)], 1)
    again = dict(attention_mask=longer, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(out.sequences, cache=out.cache, **again),
                       model.generate(ref.sequences, cache=ref.cache, **again))


def test_an_engine_takes_token_types_from_every_request_or_none():
    model = model_for("gpt2")
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine = Engine(model, block_size=4, num_blocks=16)
    engine.add_request([5, 6, 7], params)
    with pytest.raises(ValueError, match="request 1: has token types"):
        engine.add_request([5, 6, 7], params, index=1, token_types=([0, 0, 0], 0))
    typed = Engine(model, block_size=4, num_blocks=16)
    typed.add_request([5, 6, 7], params, token_types=([0, 1, 0], 1))
    with pytest.raises(ValueError, match="request 2: lacks token types"):
        typed.add_request([5, 6, 7], params, index=2)
