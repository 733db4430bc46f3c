"""Every generate mode on paged memory equals HF on its DynamicCache, on five architectures (fp32, token for token;
scores, logits and hidden states to float tolerance): both front doors (`cache_implementation="paged"`, which runs
the engine or HF's loop on a PagedCache, and `cache=PagedCache(...)`), left / right / no padding,
`num_return_sequences`, assisted decoding with rejected candidates (whose crop must free the blocks past the cut),
a contrastive search, continuing from a returned cache, and plain forward loops."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_paged import PagedCache
from hf_paged.tiny import tiny_model
from takeover_helpers import batch, model_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ["llama", "mistral", "gemma2", "gpt2", "qwen3"]  # mistral's window (8) and gemma2's (16) are crossed below
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=8, num_return_sequences=2),
    "beam": dict(num_beams=3, do_sample=False, num_return_sequences=2),
    "beam_sample": dict(num_beams=2, do_sample=True, top_k=8, num_return_sequences=2),
}
OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


def generate(model, ids, mask=None, seed=0, new=8, **kwargs):
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kwargs)


def close(a, b, tol=1e-4):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def assert_same(out, ref):
    """Sequences equal; every per-step score and logit (and beam scores / indices) equal to float tolerance."""
    assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
    for name in ("scores", "logits"):
        assert len(getattr(out, name)) == len(getattr(ref, name))
        for a, b in zip(getattr(out, name), getattr(ref, name)):
            close(a, b)
    if getattr(ref, "sequences_scores", None) is not None:
        close(out.sequences_scores, ref.sequences_scores)
        assert torch.equal(out.beam_indices, ref.beam_indices)


def paddings(side: str, seed: int):
    """Three rows: ragged on the given side, or all the same length (no padding). 14+ tokens cross both windows."""
    if side == "none":
        return batch((14, 14, 14), seed=seed)
    return batch((6, 14, 10), seed=seed, side=side)


@pytest.mark.parametrize("side", ["left", "right", "none"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_padding_and_architecture(arch, mode, side):
    model = model_for(arch)
    ids, mask = paddings(side, seed=21)
    ref = generate(model, ids, mask, **MODES[mode], **OUTPUTS)
    taken_over = generate(model, ids, mask, cache_implementation="paged", **MODES[mode], **OUTPUTS)
    assert_same(taken_over, ref)
    assert isinstance(taken_over.cache, PagedCache)
    cache = PagedCache(model.config, block_size=4)
    passed = generate(model, ids, mask, cache=cache, **MODES[mode], **OUTPUTS)
    assert_same(passed, ref)
    assert passed.cache is cache and cache.get_seq_length() == passed.sequences.shape[1] - 1


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_in_every_mode(arch, mode):
    model = model_for(arch)
    ids, mask = paddings("left", seed=22)
    kwargs = dict(**MODES[mode], **OUTPUTS, output_hidden_states=True, new=5)
    ref = generate(model, ids, mask, **kwargs)
    out = generate(model, ids, mask, cache=PagedCache(model.config, block_size=4), **kwargs)
    assert_same(out, ref)
    assert len(out.hidden_states) == len(ref.hidden_states) == 5
    for step_out, step_ref in zip(out.hidden_states, ref.hidden_states):
        for a, b in zip(step_out, step_ref):
            close(a, b, 1e-5)


# ---- assisted decoding ---------------------------------------------------------------------------------------
ASSISTANTS: dict[str, torch.nn.Module] = {}


def assisted_kwargs(arch: str, how: str) -> dict:
    """A differently seeded model of the same shape as assistant (its drafts are often rejected), or prompt lookup."""
    if how == "prompt_lookup":
        return dict(prompt_lookup_num_tokens=3)
    if arch not in ASSISTANTS:
        ASSISTANTS[arch] = tiny_model(arch, seed=1, **({"tie_word_embeddings": False} if arch == "gpt2" else {}))
    return dict(assistant_model=ASSISTANTS[arch])


def repeated_prompt(seed: int) -> torch.Tensor:
    """Text that repeats itself, so that prompt lookup finds candidates (HF assists one row at a time)."""
    return torch.cat([batch((10,), seed=seed)[0]] * 2, dim=1)


@pytest.mark.parametrize("door", ["cache_implementation", "cache"])
@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("how", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("arch", ARCHS)
def test_assisted_decoding(arch, how, do_sample, door):
    model = model_for(arch)
    ids = repeated_prompt(seed=23)
    kwargs = dict(do_sample=do_sample, new=12, **assisted_kwargs(arch, how), **OUTPUTS)
    ref = generate(model, ids, **kwargs)
    front = (dict(cache_implementation="paged") if door == "cache_implementation"
             else dict(cache=PagedCache(model.config, block_size=4)))
    out = generate(model, ids, **kwargs, **front)
    assert_same(out, ref)
    assert isinstance(out.cache, PagedCache) and out.cache.get_seq_length() == out.sequences.shape[1] - 1


class RecordingCache(PagedCache):
    """A PagedCache that notes, at every crop, the length and the blocks held before and after."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.crops = []

    def crop(self, tokens_to_remove: int) -> None:
        before = (self.get_seq_length(), self.store.num_blocks_in_use)
        super().crop(tokens_to_remove)
        self.crops.append((*before, self.get_seq_length(), self.store.num_blocks_in_use,
                           self.store.pool.num_free_blocks))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_crop_after_rejected_drafts_frees_the_blocks_past_the_cut(arch):
    """Assisted decoding writes the drafts' K/V, then crops the rejected ones: with 2-token blocks a cut that
    crosses a block boundary must give those blocks back to the pool, and the result stays HF's."""
    model = model_for(arch)
    ids = repeated_prompt(seed=24)
    kwargs = dict(do_sample=False, new=16, **assisted_kwargs(arch, "assistant"))
    cache = RecordingCache(model.config, block_size=2)
    out = generate(model, ids, cache=cache, **kwargs)
    assert torch.equal(out, generate(model, ids, **kwargs))
    cuts = [c for c in cache.crops if c[2] < c[0]]
    assert cuts, f"no draft was rejected: {cache.crops}"
    window = getattr(model.config, "sliding_window", None)
    for length_before, blocks_before, length, blocks, free in cache.crops:
        # one row: exactly the blocks its length needs, less those wholly left behind by mistral's window
        gone = max(0, length - window + 1) // 2 if window else 0
        assert blocks == math.ceil(length / 2) - gone, (length, blocks)
        assert free == cache.store.pool.num_blocks - blocks
    assert any(blocks < blocks_before for _, blocks_before, _, blocks, _ in cuts), cache.crops


# ---- contrastive search ----------------------------------------------------------------------------------------
def contrastive_search(model, input_ids, logits_processor, stopping_criteria, generation_config, alpha=0.6,
                       candidates=4, **model_kwargs):
    """A contrastive search as a `custom_generate` loop (transformers ships it on the Hub, which these tests cannot
    reach): per step the top `candidates` tokens each run one forward on a copy of every row's cache
    (`batch_repeat_interleave`), are scored by (1 - alpha) * probability - alpha * the highest cosine similarity
    of their last hidden state to the row's earlier ones, and the winners' caches are kept (`batch_select_indices`)."""
    cache, mask = model_kwargs["cache"], model_kwargs["attention_mask"]
    rows = input_ids.shape[0]
    mask = torch.ones_like(input_ids) if mask is None else mask
    out = model(input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache,
                use_cache=True, output_hidden_states=True)
    history, logits = out.hidden_states[-1], out.logits[:, -1]
    while True:
        probs = logits_processor(input_ids, logits).softmax(-1)
        top_probs, top_ids = probs.topk(candidates, dim=-1)
        cache.batch_repeat_interleave(candidates)
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        wide_mask = mask.repeat_interleave(candidates, dim=0)
        out = model(top_ids.reshape(-1, 1), attention_mask=wide_mask, position_ids=wide_mask.sum(-1, keepdim=True) - 1,
                    cache=cache, use_cache=True, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -1]
        similarity = F.normalize(hidden, dim=-1)[:, None] @ F.normalize(
            history.repeat_interleave(candidates, dim=0), dim=-1).transpose(1, 2)
        past = wide_mask[:, None, :-1].bool()
        penalty = similarity.masked_fill(~past, -1.0).amax(-1).reshape(rows, candidates)
        best = ((1 - alpha) * top_probs - alpha * penalty).argmax(-1)
        chosen = torch.arange(rows) * candidates + best
        cache.batch_select_indices(chosen)
        input_ids = torch.cat([input_ids, top_ids[torch.arange(rows), best][:, None]], dim=1)
        history = torch.cat([history, hidden[chosen][:, None]], dim=1)
        logits = out.logits[chosen, -1]
        if stopping_criteria(input_ids, logits).all():
            return input_ids


@pytest.mark.parametrize("side", ["left", "right", "none"])
@pytest.mark.parametrize("arch", ARCHS)
def test_contrastive_search(arch, side):
    model = model_for(arch)
    ids, mask = paddings(side, seed=25)
    kwargs = dict(custom_generate=contrastive_search, do_sample=False, eos_token_id=None, new=10)
    ref = generate(model, ids, mask, **kwargs)
    assert torch.equal(generate(model, ids, mask, cache_implementation="paged", **kwargs), ref)
    assert torch.equal(generate(model, ids, mask, cache=PagedCache(model.config, block_size=4), **kwargs), ref)
    greedy = generate(model, ids, mask, do_sample=False, eos_token_id=None, new=10)
    assert not torch.equal(ref, greedy), "the penalty never changed a choice: not a contrastive search"


# ---- continuing from a returned cache ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["greedy", "sample", "assisted"])
@pytest.mark.parametrize("arch", ARCHS)
def test_continue_from_the_returned_cache(arch, mode):
    """Two calls, the second continuing from the first's `out.cache`, give what they give on DynamicCache; for
    greedy (and assisted decoding, which is greedy) also what one longer call gives."""
    model = model_for(arch)
    if mode == "assisted":
        ids, mask = repeated_prompt(seed=26), None
        first_kwargs = dict(do_sample=False, **assisted_kwargs(arch, "assistant"))
    else:
        ids, mask = batch((5, 11, 8), seed=26)
        first_kwargs = dict(do_sample=mode == "sample", top_k=8 if mode == "sample" else None)
    later = dict(do_sample=mode == "sample", top_k=8 if mode == "sample" else None, new=9)

    def two_calls(**front):
        first = generate(model, ids, mask, seed=3, new=6, return_dict_in_generate=True, **first_kwargs, **front)
        longer = None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], 6)], dim=1)
        return first.cache, generate(model, first.sequences, longer, seed=4, cache=first.cache, **later)

    ref_cache, ref = two_calls()
    cache, out = two_calls(cache_implementation="paged")
    assert isinstance(cache, PagedCache) and not isinstance(ref_cache, PagedCache)
    assert torch.equal(out, ref)
    if mode != "sample":
        whole = generate(model, ids, mask, do_sample=False, new=15)
        assert torch.equal(out, whole)


# ---- plain forward loops --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_plain_forward_loop_on_a_padded_batch(arch):
    """`model(ids, cache=..., use_cache=True)` step by step on a left-padded batch: the same logits as DynamicCache,
    the same lengths; the prompt crosses both windows."""
    model = model_for(arch)
    ids, mask = batch((9, 20), seed=27)
    steps = batch((1, 1), seed=28)[0].repeat(1, 8)
    logits = {}
    for name, cache in (("paged", PagedCache(model.config, block_size=4)), ("dynamic", DynamicCache(config=model.config))):
        seen, current = [], mask
        with torch.no_grad():
            seen.append(model(ids, attention_mask=current, cache=cache, use_cache=True).logits)
            for t in range(steps.shape[1]):
                current = torch.cat([current, current.new_ones(2, 1)], dim=1)
                seen.append(model(steps[:, t:t + 1], attention_mask=current, cache=cache, use_cache=True).logits)
        assert cache.get_seq_length() == 28
        logits[name] = seen
    for a, b in zip(logits["paged"], logits["dynamic"]):
        close(a, b, 1e-5)
