"""`generate(..., cache_implementation="paged")` honours every generation option exactly as HF's loop does:
padding, EOS, lengths, num_return_sequences, processors, criteria, stop strings, streamers, dict outputs,
sampling. Comparisons are exact; every paged call is checked to have run on the engine."""
from __future__ import annotations


import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList)
from transformers.generation.streamers import BaseStreamer


from takeover_helpers import (EOS, PAD, assert_ragged, batch, make_tokenizer, model_for, on_engine, paged, ragged_eos, state)  # noqa: F401


# ---- 2. padding, EOS, lengths, num_return_sequences ----------------------------------------------------
def test_right_padded_batch_equals_hf(engine_runs):
    """HF warns about right padding but still produces a result: the first new token comes from the last pad
    (attending to the real tokens), the next ones continue from that pad's position. The engine does the same."""
    model = model_for()
    ids, mask = batch((3, 8, 5), side="right")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_early_eos_ragged_finish(arch, engine_runs):
    model = model_for(arch)
    ids, mask = batch((3, 7, 12), seed=2)
    eos, _ = ragged_eos(model, ids, mask)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert_ragged(ref, ids.shape[1], eos)
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert torch.equal(out, ref)


def test_eos_token_id_list(engine_runs):
    model = model_for()
    ids, mask = batch((3, 7, 12), seed=2)
    eos, new = ragged_eos(model, ids, mask)
    other = int(new[-1, 2]) if int(new[-1, 2]) != eos else int(new[-1, 3])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[other, eos])
    assert (ref[:, ids.shape[1]:] == PAD).any()
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                eos_token_id=[other, eos])
    assert torch.equal(out, ref)


def test_max_length(engine_runs):
    model = model_for()
    ids, mask = batch((4, 9))
    ref = model.generate(ids, attention_mask=mask, max_length=ids.shape[1] + 6, do_sample=False)
    assert ref.shape[1] == ids.shape[1] + 6
    out = paged(model, engine_runs, ids, attention_mask=mask, max_length=ids.shape[1] + 6, do_sample=False)
    assert torch.equal(out, ref)


def test_min_new_tokens(engine_runs):
    model = model_for()
    ids, mask = batch((3, 7, 12), seed=2)
    eos, _ = ragged_eos(model, ids, mask)
    early = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                         min_new_tokens=8)
    assert not torch.equal(ref, early), "min_new_tokens changed nothing: the test would prove nothing"
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                min_new_tokens=8)
    assert torch.equal(out, ref)


def test_num_return_sequences_greedy_is_rejected_like_hf(engine_runs):
    model = model_for()
    ids, mask = batch((3, 5))
    with pytest.raises(ValueError) as hf_error:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_return_sequences=2)
    with pytest.raises(ValueError) as paged_error:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_return_sequences=2,
                       cache_implementation="paged")
    assert str(paged_error.value) == str(hf_error.value)


def test_num_return_sequences_top_k_1_equals_hf(engine_runs):
    """top_k=1 sampling is deterministic: equal to HF token for token, each prompt repeated twice in order."""
    model = model_for()
    ids, mask = batch((3, 7, 5), seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=1, num_return_sequences=2)
    torch.manual_seed(0)
    ref = model.generate(ids, **kwargs)
    torch.manual_seed(0)
    out = paged(model, engine_runs, ids, **kwargs)
    assert out.shape == (6, ids.shape[1] + 8)
    assert torch.equal(out, ref)


def test_num_return_sequences_sampled(engine_runs):
    model = model_for()
    ids, mask = batch((3, 7), seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=1.5, num_return_sequences=2)
    torch.manual_seed(0)
    ref = model.generate(ids, **kwargs)
    torch.manual_seed(0)
    out = paged(model, engine_runs, ids, **kwargs)
    assert out.shape == ref.shape
    width = ids.shape[1]
    assert torch.equal(out[:, :width], ref[:, :width])
    assert torch.equal(out[:, :width], ids.repeat_interleave(2, dim=0))
    # the paged path draws for the whole batch each step, like HF, so the same seed gives HF's very samples
    assert torch.equal(out, ref)


# ---- 3. processors, criteria, stop strings, streamer, dict outputs ------------------------------------
def test_repetition_penalty(engine_runs):
    model = model_for()
    ids, mask = batch((3, 7, 12))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, repetition_penalty=3.0)
    assert not torch.equal(plain, ref), "the penalty changed nothing: the test would prove nothing"
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                repetition_penalty=3.0)
    assert torch.equal(out, ref)


class NoRepeatLast(LogitsProcessor):
    """Forbid each row's previous token (depends on the exact input_ids HF would hold, padding included)."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores.scatter_(1, input_ids[:, -1:], float("-inf"))
        return scores


class StopAbove(StoppingCriteria):
    """Per-row stop once a generated token is above `threshold`."""

    def __init__(self, prompt_len, threshold):
        self.prompt_len, self.threshold = prompt_len, threshold

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] > self.threshold if input_ids.shape[1] > self.prompt_len else \
            torch.zeros(len(input_ids), dtype=torch.bool)


def test_custom_logits_processor(engine_runs):
    model = model_for()
    ids, mask = batch((3, 7, 12))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                         logits_processor=LogitsProcessorList([NoRepeatLast()]))
    assert not torch.equal(plain, ref)
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                logits_processor=LogitsProcessorList([NoRepeatLast()]))
    assert torch.equal(out, ref)


def test_custom_stopping_criteria(engine_runs):
    model = model_for()
    ids, mask = batch((3, 7, 12), seed=5)
    criteria = StoppingCriteriaList([StopAbove(ids.shape[1], 200)])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, stopping_criteria=criteria)
    new = ref[:, ids.shape[1]:]
    assert (new == PAD).any() and ref.shape[1] > ids.shape[1] + 1, "no ragged stop: pick another threshold"
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                stopping_criteria=criteria)
    assert torch.equal(out, ref)


class StopAfter(StoppingCriteria):
    """Row r stops after `counts[r]` new tokens; records what HF hands it as `scores`."""

    def __init__(self, prompt_len, counts):
        self.prompt_len, self.counts, self.seen = prompt_len, counts, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(None if scores is None else (len(scores), scores[-1].shape[-1]))
        return torch.tensor([input_ids.shape[1] - self.prompt_len >= self.counts[r] for r in range(len(input_ids))])


def test_stopped_rows_keep_generating_without_eos(engine_runs):
    """Without any EOS criterion HF does not pad rows that stopped: they keep generating real tokens until
    the last row stops."""
    model = model_for()
    ids, mask = batch((3, 7, 12))
    counts = [2, 6, 4]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                         stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1], counts)]))
    assert ref.shape[1] == ids.shape[1] + 6 and not (ref[:, ids.shape[1]:] == PAD).any()
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1], counts)]))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("output_scores", [False, True])
def test_stopping_criteria_receive_scores_like_hf(engine_runs, output_scores):
    """HF hands criteria `scores` = None, or the tuple of processed scores so far with output_scores."""
    model = model_for()
    ids, mask = batch((3, 7))
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True, output_scores=output_scores)
    hf_criteria, criteria = StopAfter(ids.shape[1], [3, 3]), StopAfter(ids.shape[1], [3, 3])
    ref = model.generate(ids, stopping_criteria=StoppingCriteriaList([hf_criteria]), **kwargs)
    out = paged(model, engine_runs, ids, stopping_criteria=StoppingCriteriaList([criteria]), **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert criteria.seen == hf_criteria.seen
    assert hf_criteria.seen == ([(1, 256), (2, 256), (3, 256)] if output_scores else [None] * 3)


def test_stop_strings(engine_runs):
    model = model_for()
    tok = make_tokenizer()
    ids, mask = batch((3, 7, 12), seed=2)
    token, new = ragged_eos(model, ids, mask)
    stop = tok.convert_ids_to_tokens(token)
    # a second stop string spanning two tokens of the last row
    span = tok.convert_tokens_to_string(tok.convert_ids_to_tokens(new[-1, 5:7].tolist()))
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, stop_strings=[stop, span],
                         tokenizer=tok)
    assert_ragged(ref, ids.shape[1], token)
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                stop_strings=[stop, span], tokenizer=tok)
    assert torch.equal(out, ref)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.detach().clone())

    def end(self):
        self.ended += 1


def test_streamer_sees_what_hf_streams(engine_runs):
    model = model_for()
    ids, mask = batch((3, 7, 12), seed=2)
    eos, _ = ragged_eos(model, ids, mask)
    ref_stream, stream = Recorder(), Recorder()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                         streamer=ref_stream)
    out = paged(model, engine_runs, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                streamer=stream)
    assert torch.equal(out, ref)
    assert (stream.ended, ref_stream.ended) == (1, 1)
    assert len(stream.puts) == len(ref_stream.puts) == ref.shape[1] - ids.shape[1] + 1
    for got, expected in zip(stream.puts, ref_stream.puts):
        assert got.shape == expected.shape and torch.equal(got, expected)


@pytest.mark.parametrize("cache_config", [None, {"block_size": 4, "max_num_batched_tokens": 5}],
                         ids=["in-step", "chunked-prefill"])
def test_return_dict_scores_and_logits(cache_config, engine_runs):
    """Scores and logits of every step, also of rows that hit EOS earlier: HF keeps computing them on their pads and
    returns theirs, and so does paged (rows out of step under chunked prefill too)."""
    model = model_for()
    ids, mask = batch((3, 7, 12), seed=2)
    eos, _ = ragged_eos(model, ids, mask, repetition_penalty=1.5)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, repetition_penalty=1.5,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = model.generate(ids, **kwargs)
    out = paged(model, engine_runs, ids, cache_config=cache_config, **kwargs)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
    assert_ragged(ref.sequences, ids.shape[1], eos)
    assert len(out.scores) == len(ref.scores) and len(out.logits) == len(ref.logits)
    for a, b in [*zip(out.scores, ref.scores), *zip(out.logits, ref.logits)]:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.equal(ref.scores[1], ref.logits[1]), "scores equal logits: the penalty did nothing"


# ---- 6. sampling ---------------------------------------------------------------------------------------
def test_sampling_reproducible_and_valid(engine_runs):
    model = model_for()
    ids, mask = batch((3, 7, 12), seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=0.9, top_k=20, top_p=0.9,
                  return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(1234)
    first = paged(model, engine_runs, ids, **kwargs)
    torch.manual_seed(1234)
    second = paged(model, engine_runs, ids, **kwargs)
    torch.manual_seed(4321)
    third = paged(model, engine_runs, ids, **kwargs)
    assert torch.equal(first.sequences, second.sequences)
    assert not torch.equal(first.sequences, third.sequences), "sampling ignored the seed"
    width = ids.shape[1]
    assert torch.equal(first.sequences[:, :width], ids)
    new = first.sequences[:, width:]
    assert ((new >= 0) & (new < 256)).all()
    for row in range(len(new)):  # every sampled token survived top-k / top-p for its own row and step
        for step, token in enumerate(new[row].tolist()):
            if step and new[row, step - 1] == EOS:
                break
            scores = first.scores[step][row]
            kept = torch.isfinite(scores)
            assert 1 <= int(kept.sum()) <= 20
            assert kept[token], f"row {row} step {step}: token {token} was filtered out"


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_sampling_with_ragged_eos_matches_hf_samples(arch, engine_runs):
    """Processors and `torch.multinomial` see the whole batch in HF's order every step (finished rows
    included), so one seed gives HF's own samples, even after rows finish at different steps."""
    model = model_for(arch)
    ids, mask = batch((3, 7, 12), seed=7)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=1.3, top_k=50, top_p=0.95,
                  repetition_penalty=1.2, eos_token_id=[EOS, *range(100, 125)])
    torch.manual_seed(0)
    ref = model.generate(ids, **kwargs)
    trailing_pads = {int((row.flip(0).cumprod(0) == 1).sum()) for row in (ref[:, ids.shape[1]:] == PAD).int()}
    assert len(trailing_pads) > 1, f"rows did not finish at different steps: {ref.tolist()}"
    torch.manual_seed(0)
    out = paged(model, engine_runs, ids, **kwargs)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("cache_config", [
    {"block_size": 4, "num_blocks": 12},  # too small a pool: rows are preempted and recomputed
    {"block_size": 4, "max_num_batched_tokens": 5},  # chunked prefill: rows start sampling at different steps
    {"max_num_seqs": 2},  # two rows at a time: the last rows start after the first ones finished
], ids=["preemption", "chunked-prefill", "max-num-seqs"])
def test_rows_out_of_step_keep_hf_semantics(cache_config, engine_runs):
    """Rows the engine runs out of step still see HF's batch: per-row processor state (the repetition
    penalty's prompt lengths), per-row criteria, pads, streamer columns and no-EOS stops all equal HF."""
    model = model_for()
    ids, mask = batch((3, 7, 12, 9), seed=2)
    eos, _ = ragged_eos(model, ids, mask, repetition_penalty=1.5)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, repetition_penalty=1.5)
    ref_stream, stream = Recorder(), Recorder()
    ref = model.generate(ids, streamer=ref_stream, **kwargs)
    assert_ragged(ref, ids.shape[1], eos)
    out = paged(model, engine_runs, ids, streamer=stream, cache_config=cache_config, **kwargs)
    assert torch.equal(out, ref)
    assert len(stream.puts) == len(ref_stream.puts)
    assert all(torch.equal(a, b) for a, b in zip(stream.puts, ref_stream.puts))
    stats = engine_runs[-1].engine.stats()
    if "num_blocks" in cache_config:
        assert stats["num_preemptions"] > 0, stats

    counts = [2, 6, 4, 3]
    kwargs.update(eos_token_id=None)
    ref = model.generate(ids, stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1], counts)]), **kwargs)
    out = paged(model, engine_runs, ids, stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1], counts)]),
                cache_config=cache_config, **kwargs)
    assert torch.equal(out, ref)
