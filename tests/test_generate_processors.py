"""Paged `generate` calls HF's logits processors as HF's own loop does: once per generated position, with the whole
batch ([batch, vocab] scores, [batch, length] input_ids, finished rows included), and samples the batch with one
`torch.multinomial` call, also when the engine completes the prompts in different steps (chunked prefill). Processors
that count calls or read other rows, `guidance_scale` and seeded sampling give HF's tokens; the returned logits are
the tensor HF hands the processors (edits in place included). Where the engine cannot hold every row in one step,
such calls run HF's own loop."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from takeover_helpers import EOS, PAD, batch, model_for, paged, ragged_eos

LENGTHS = (5, 30, 12, 22)  # 69 prompt tokens
SPLIT = {"max_num_batched_tokens": 8, "block_size": 4}  # rows finish their prefill in different engine steps
LONG = (470, 90, 480, 300, 475, 460, 20, 478, 465, 472, 500, 420)  # 4,630 prompt tokens: over the default budget


class Stateful(LogitsProcessor):
    """Favours a token that changes with every call, by an amount that depends on all rows (the batch mean of the
    scores); records what it was called with."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.clone(), scores.clone()))
        out = scores + 0.5 * scores.mean(dim=0, keepdim=True)
        out[:, 3 + (7 * len(self.calls)) % 250] += 4.0 * scores.std()
        return out


class InPlace(LogitsProcessor):
    """Edits the scores it is given in place (HF then returns the edited tensor as the step's logits)."""

    def __call__(self, input_ids, scores):
        scores[:, 5] += 100.0
        scores[:, int(input_ids[0, -1])] -= 3.0
        return scores


def processors(*items):
    return {"logits_processor": LogitsProcessorList(list(items))}


@pytest.mark.parametrize("with_eos, lengths, cache_config", [
    (False, LENGTHS, SPLIT), (True, LENGTHS, SPLIT), (False, LONG, None)], ids=["no-eos", "ragged-eos", "default"])
def test_stateful_processor_sees_hf_batches(with_eos, lengths, cache_config, engine_runs):
    """One call per step with every row, in HF's order, with HF's input_ids and scores (finished rows' scores are
    HF's too: computed from their pads); greedy tokens equal HF's. "default": the engine's default token budget, with
    more prompt tokens than it holds."""
    assert sum(lengths) > (cache_config or {}).get("max_num_batched_tokens", 4096), "the prompts fit one step"
    model = model_for()
    ids, mask = batch(lengths, seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    if with_eos:
        kwargs["eos_token_id"], _ = ragged_eos(model, ids, mask, **processors(Stateful()))
    ref_processor, processor = Stateful(), Stateful()
    ref = model.generate(ids, **kwargs, **processors(ref_processor))
    if with_eos:
        assert (ref[:, -1] == PAD).any(), "no row finished early"
    out = paged(model, engine_runs, ids, cache_config=cache_config, **kwargs, **processors(processor))
    assert torch.equal(out, ref)
    assert len(processor.calls) == len(ref_processor.calls)
    for (ids_got, scores_got), (ids_ref, scores_ref) in zip(processor.calls, ref_processor.calls):
        assert torch.equal(ids_got, ids_ref)
        torch.testing.assert_close(scores_got, scores_ref, rtol=1e-4, atol=1e-4)


def test_guidance_scale(engine_runs):
    """Classifier-free guidance runs the model on its own cache once per call: one call per HF step."""
    model = model_for()
    ids, mask = batch(LENGTHS, seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, guidance_scale=1.5)
    ref = model.generate(ids, **kwargs)
    out = paged(model, engine_runs, ids, cache_config=SPLIT, **kwargs)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("lengths, cache_config", [(LENGTHS, SPLIT), (LONG, None)], ids=["split-prefill", "default"])
def test_seeded_sampling_equals_hf(lengths, cache_config, engine_runs):
    """One `torch.multinomial` over the whole batch per step: HF's draws under the same seed, rows finishing at
    different steps included."""
    model = model_for()
    ids, mask = batch(lengths, seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=1.2, top_k=0,
                  eos_token_id=[EOS, *range(100, 110)])
    torch.manual_seed(7)
    ref = model.generate(ids, **kwargs)
    torch.manual_seed(7)
    out = paged(model, engine_runs, ids, cache_config=cache_config, **kwargs)
    assert torch.equal(out, ref)


def test_seeded_sampling_with_stateful_processor_and_return_sequences(engine_runs):
    model = model_for()
    ids, mask = batch(LENGTHS[:3], seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, num_return_sequences=2)
    torch.manual_seed(3)
    ref = model.generate(ids, **kwargs, **processors(Stateful()))
    torch.manual_seed(3)
    out = paged(model, engine_runs, ids, cache_config=SPLIT, **kwargs, **processors(Stateful()))
    assert torch.equal(out, ref)


def test_in_place_processor_and_output_logits(engine_runs):
    """HF keeps the tensor it hands the processors as the step's logits: edits made in place show in them."""
    model = model_for()
    ids, mask = batch(LENGTHS, seed=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, output_scores=True)
    ref = model.generate(ids, **kwargs, **processors(InPlace()))
    assert torch.equal(ref.logits[0], ref.scores[0]), "HF did not return the edited tensor"
    out = paged(model, engine_runs, ids, cache_config=SPLIT, **kwargs, **processors(InPlace()))
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits)
    for got, expected in [*zip(out.logits, ref.logits), *zip(out.scores, ref.scores)]:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cache_config", [
    {"max_num_seqs": 2},  # not every row runs at once
    {"max_num_batched_tokens": 3},  # not every row gets a token in one step
    {"block_size": 4, "num_blocks": 8},  # the pool cannot hold every row (rows would be preempted)
], ids=["max-num-seqs", "token-budget", "small-pool"])
def test_sampling_runs_hf_loop_where_rows_cannot_step_together(cache_config, engine_runs, caplog):
    """Where the engine cannot give every row its token in one step, sampling runs HF's own loop (one warning)."""
    model = model_for()
    ids, mask = batch(LENGTHS, seed=9)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True)
    torch.manual_seed(11)
    ref = model.generate(ids, **kwargs, **processors(Stateful()))
    torch.manual_seed(11)
    out = model.generate(ids, cache_implementation="paged", cache_config=cache_config, **kwargs,
                         **processors(Stateful()))
    assert torch.equal(out, ref)
    assert not engine_runs and "transformers' own generate loop" in caplog.text
