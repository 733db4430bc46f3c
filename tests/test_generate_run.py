"""integrations/generate_run.py, `GenerateRun` (one generate take-over call) as a unit: what it reads from HF's
prepared call (rows, padding, pad / EOS, right-padded rows, token types), when the engine's own sampler suffices,
the engine it asks for, lockstep, the controller's `process` (HF's ids, processors, pads after a row stops, the
common final length), streaming columns and the returned tensor / dict. Requests and engines are small stand-ins;
one run at the end goes through a real engine on a tiny model. (tests/test_generate*.py compare whole generate
calls with HF's.)"""
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from conftest import cached_model, left_padded_batch
from hf_paged.engine import Engine
from hf_paged.integrations.generate_run import GenerateRun

VOCAB = 10
EOS, PAD = 2, 0


def config(max_length=8, pad=PAD, eos=EOS, **options):
    cfg = GenerationConfig(max_length=max_length, **options)
    cfg._pad_token_tensor = None if pad is None else torch.tensor(pad)
    cfg._eos_token_tensor = None if eos is None else torch.tensor(eos if isinstance(eos, list) else [eos])
    return cfg


def criteria(max_length=8, eos=True):
    found = [MaxLengthCriteria(max_length)]
    if eos:
        found.append(EosTokenCriteria(torch.tensor([EOS])))
    return StoppingCriteriaList(found)


def make_run(ids=((5, 6, 7), (0, 8, 9)), mask=((1, 1, 1), (0, 1, 1)), max_length=8, processors=(), eos_criterion=True,
             streamer=None, **cfg_options):
    ids = torch.tensor(ids)
    mask = None if mask is None else torch.tensor(mask)
    return GenerateRun(None, ids, mask, config(max_length, **cfg_options), LogitsProcessorList(processors),
                       criteria(max_length, eos_criterion), streamer)


class Row:
    """What GenerateRun reads of an engine request."""

    def __init__(self, index, outputs=(), finished=False):
        self.index, self.output_token_ids, self.finished, self.forks = index, list(outputs), finished, []

    @property
    def num_output_tokens(self):
        return len(self.output_token_ids)

    @property
    def is_finished(self):
        return self.finished


def logits_for(*tokens):
    """One row of logits per token, each peaking at that token."""
    out = torch.zeros(len(tokens), VOCAB)
    for i, t in enumerate(tokens):
        out[i, t] = 5.0
    return out


# ---- what it reads from the call ------------------------------------------------------------------------------
def test_prompts_drop_padding_and_new_tokens_fill_to_max_length():
    run = make_run()
    assert run.rows == [[5, 6, 7], [0, 8, 9]] and run.prompts == [[5, 6, 7], [8, 9]]
    assert run.first_queries == [None, None] and run.max_new_tokens == 5
    assert make_run(mask=None).prompts == [[5, 6, 7], [0, 8, 9]]  # without a mask every token is real
    assert make_run(max_length=2).max_new_tokens == 1  # at least one


def test_right_padded_rows_sample_from_their_last_pad_at_hf_s_position():
    ids, mask = torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="right-padded row needs HF's position_ids"):
        GenerateRun(None, ids, mask, config(), LogitsProcessorList(), criteria(), None)
    positions = torch.tensor([[0, 1, 2], [0, 1, 1]])
    run = GenerateRun(None, ids, mask, config(), LogitsProcessorList(), criteria(), None, position_ids=positions)
    assert run.prompts == [[5, 6, 7], [8, 9]] and run.first_queries == [None, (0, 1)]


def test_token_types_of_real_tokens_and_of_new_tokens():
    ids, mask = torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    types = torch.tensor([[0, 0, 1], [1, 0, 0]])
    run = GenerateRun(None, ids, mask, config(), LogitsProcessorList(), criteria(), None, token_type_ids=types)
    assert run.token_types == [([0, 0, 1], 1), ([0, 0], 0)]
    assert make_run().token_types == [None, None]


@pytest.mark.parametrize("pad, eos, expected_pad, expected_eos", [
    (PAD, EOS, PAD, [EOS]), (None, [4, 3], 4, [4, 3]), (None, None, 0, []), (7, [-1], 7, []), (None, [-1, 5], -1, [5])])
def test_pad_and_eos(pad, eos, expected_pad, expected_eos):
    run = make_run(pad=pad, eos=eos)
    assert run.pad == expected_pad and run.eos == expected_eos


# ---- which sampler, which engine ----------------------------------------------------------------------------
def test_greedy_with_length_and_eos_stops_is_native():
    run = make_run()
    assert run.native and run.finish_at_stop and not run.must_lockstep
    params = run.sampling_params()
    assert params.max_tokens == 5 and params.temperature == 0.0 and params.ignore_eos
    assert params.stop_token_ids == [EOS]


@pytest.mark.parametrize("change", ["sample", "processor", "scores", "logits", "stop_string"])
def test_anything_hf_s_loop_does_beyond_that_is_not_native(change):
    if change == "sample":
        run = make_run(do_sample=True)
    elif change == "processor":
        run = make_run(processors=[RepetitionPenaltyLogitsProcessor(1.3)])
    elif change == "stop_string":
        run = make_run()
        run.stopping_criteria.append(type("StopStringCriteria", (), {})())  # a criterion of another kind
    else:
        run = make_run(return_dict_in_generate=True, **{f"output_{change}": True})
    assert not run.native
    assert run.sampling_params().stop_token_ids == []  # the controller decides every stop


def test_rows_run_on_to_the_common_length_without_an_eos_criterion_or_when_hf_returns_their_pads():
    assert not make_run(eos_criterion=False).finish_at_stop
    assert not make_run(eos_criterion=False).pads_finished
    assert not make_run(return_dict_in_generate=True).finish_at_stop  # the returned cache holds the pads' K/V
    assert make_run(return_dict_in_generate=True, use_cache=False).finish_at_stop
    assert not make_run(return_dict_in_generate=True, output_scores=True, use_cache=False).finish_at_stop
    assert make_run(processors=[TemperatureLogitsWarper(0.5)]).finish_at_stop  # HF's row-wise processor


def test_processors_that_may_read_other_rows_need_lockstep():
    class Custom(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    run = make_run(processors=[Custom()])
    assert run.must_lockstep and not run.finish_at_stop
    assert make_run(do_sample=True).must_lockstep
    assert not make_run(processors=[RepetitionPenaltyLogitsProcessor(1.3)]).must_lockstep


def test_engine_config_sizes_the_pool_to_the_batch():
    run = make_run()  # 3 + 5 and 2 + 5 tokens: 1 block each at 16, 2 each at 4
    config = run.engine_config(None)
    assert config.num_blocks == 2 and config.preemption_mode == "recompute" and config.cuda_graphs is False
    assert run.engine_config({"block_size": 4}).num_blocks == 4
    assert run.engine_config({"num_blocks": 64}).num_blocks == 64  # the caller's pool stays
    assert run.engine_config({"preemption_mode": "swap"}).preemption_mode == "swap"


def test_controlled_rows_all_fit_one_step_unless_the_caller_set_limits():
    run = make_run(ids=[[5, 6, 7]] * 6, mask=None, do_sample=True)
    config = run.engine_config({"max_num_seqs": 1, "max_num_batched_tokens": 2})
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1, 2)  # the caller's
    defaults = run.engine_config(None)
    assert defaults.max_num_seqs >= 6 and defaults.max_num_batched_tokens >= 6


def test_lockstep_blocker_names_what_is_too_small():
    run = make_run()

    def engine(seqs=8, tokens=64, blocks=2, block_size=16):
        return SimpleNamespace(config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens,
                                                      block_size=block_size),
                               memory=SimpleNamespace(num_blocks=blocks))

    assert run.lockstep_blocker(engine()) is None
    assert run.lockstep_blocker(engine(seqs=1)) == "2 rows with max_num_seqs=1"
    assert run.lockstep_blocker(engine(tokens=1)) == "2 rows with max_num_batched_tokens=1"
    assert run.lockstep_blocker(engine(blocks=1)) == "a KV pool of 1 blocks, for rows that need up to 2"
    assert run.lockstep_blocker(engine(blocks=4, block_size=4)) is None
    assert "need up to 4" in run.lockstep_blocker(engine(blocks=3, block_size=4))


def test_holds_back_waits_for_every_unfinished_row_in_lockstep():
    run = make_run()
    a, b = Row(0, [4]), Row(1)
    run.requests = [a, b]
    assert not run.holds_back([a])  # not in lockstep: never
    run.lockstep = True
    assert run.holds_back([a]) and not run.holds_back([a, b])
    b.finished = True
    assert not run.holds_back([a])
    b.finished = False
    a.output_token_ids, a.forks = [], [b]  # b is a fork of a not yet sampled: it samples with a
    assert not run.holds_back([a])


# ---- the controller ---------------------------------------------------------------------------------------
def test_row_wise_processing_ends_a_row_at_its_eos():
    run = make_run(processors=[TemperatureLogitsWarper(1.0)])  # not native, but rows end when they stop
    run.requests = [Row(0), Row(1)]
    assert run.process(run.requests, logits_for(EOS, 4)) == [(EOS, True), (4, False)]
    assert run.stopped == {}  # nothing to wait for


def test_process_hands_hf_s_ids_to_processors_and_pads_rows_that_stopped():
    seen = []

    class Spy(LogitsProcessor):  # may read other rows: stopped rows run on, on pads, as in HF
        def __call__(self, input_ids, scores):
            seen.append(input_ids.tolist())
            return scores

    run = make_run(processors=[Spy()])
    run.requests = [Row(0), Row(1)]
    assert run.process(run.requests, logits_for(EOS, 4)) == [(EOS, False), (4, False)]
    assert seen == [[[5, 6, 7], [0, 8, 9]]] and run.stopped == {0: 1}
    run.requests[0].output_token_ids.append(EOS)
    run.requests[1].output_token_ids.append(4)
    picks = run.process(run.requests, logits_for(5, EOS))
    assert seen[-1] == [[5, 6, 7, EOS], [0, 8, 9, 4]]
    assert picks == [(PAD, True), (EOS, True)]  # row 0 gets a pad, not its argmax; both end at the last stop
    assert run.length == 2 and run.stopped == {0: 1, 1: 2}


def test_process_groups_rows_by_length_and_fills_the_others_with_pads():
    seen = []

    class Spy(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append((input_ids.tolist(), scores.clone()))
            return scores

    run = make_run(processors=[Spy()])
    run.requests = [Row(0, [4, 5]), Row(1, [3])]
    picks = run.process(run.requests, logits_for(6, 7))
    assert picks == [(6, False), (7, False)]
    (ids_a, scores_a), (ids_b, scores_b) = seen
    assert ids_a == [[5, 6, 7, 4, 5], [0, 8, 9, 3, PAD]]  # row 1 is shorter: padded, its logits zero
    assert scores_a[1].abs().sum() == 0 and scores_a[0].argmax() == 6
    assert ids_b == [[5, 6, 7, 4], [0, 8, 9, 3]] and scores_b[0].abs().sum() == 0


def test_lockstep_refuses_rows_out_of_step():
    run = make_run(do_sample=True)
    run.requests, run.lockstep = [Row(0, [4]), Row(1)], True
    with pytest.raises(RuntimeError, match="out of step"):
        run.process(run.requests, logits_for(1, 1))


def test_without_an_eos_criterion_every_row_runs_to_the_last_stop():
    run = make_run(eos_criterion=False, max_length=6, processors=[TemperatureLogitsWarper(1.0)])
    run.requests = [Row(0), Row(1)]
    run.stopping_criteria.append(StopAt(row=0, length=4))
    assert run.process(run.requests, logits_for(4, 4)) == [(4, False), (4, False)]
    assert run.stopped == {0: 1} and run.length is None
    for r in run.requests:
        r.output_token_ids.append(4)
    run.stopping_criteria.append(StopAt(row=1, length=5))
    assert run.process(run.requests, logits_for(3, 3)) == [(3, True), (3, True)]  # row 0 is not padded: no EOS rule
    assert run.stopped == {0: 1, 1: 2} and run.length == 2


class StopAt:
    """A stopping criterion that stops `row` once input_ids reach `length` columns."""

    def __init__(self, row, length):
        self.row, self.length = row, length

    def __call__(self, input_ids, scores):
        out = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        out[self.row] = input_ids.shape[1] >= self.length
        return out


def test_a_processor_s_exception_is_kept_and_raised():
    class Boom(LogitsProcessor):
        def __call__(self, input_ids, scores):
            raise KeyError("from the processor")

    run = make_run(processors=[Boom()])
    run.requests = [Row(0), Row(1)]
    with pytest.raises(KeyError, match="from the processor"):
        run.process(run.requests, logits_for(1, 1))
    assert isinstance(run.error, KeyError)


def test_scores_and_logits_are_kept_per_row_and_stacked_with_zeros_after_a_row_ends():
    def double(input_ids, scores):
        return scores * 2

    run = make_run(processors=[double], return_dict_in_generate=True, output_scores=True, output_logits=True)
    run.requests = [Row(0), Row(1)]
    run.process(run.requests, logits_for(4, 5))
    run.requests[0].output_token_ids.append(4)
    run.requests[1].output_token_ids.append(5)
    run.process([run.requests[0]], logits_for(6))
    scores = run._stack(run.scores, 2)
    assert len(scores) == 2 and scores[0].shape == (2, VOCAB)
    assert scores[0][0, 4] == 10.0 and scores[0][1, 5] == 10.0 and scores[1][0, 6] == 10.0
    assert scores[1][1].abs().sum() == 0  # row 1 had no second step
    assert run._stack(run.raw_logits, 2)[0][0, 4] == 5.0  # the logits before processing
    assert run._stack([[], []], 3) is None


# ---- streaming and results ----------------------------------------------------------------------------------
class Streamer:
    def __init__(self):
        self.columns, self.ended = [], False

    def put(self, t):
        self.columns.append(t.tolist())

    def end(self):
        self.ended = True


def test_stream_ready_hands_over_complete_columns_once():
    streamer = Streamer()
    run = make_run(streamer=streamer)
    a, b = Row(0, [4, 5]), Row(1, [6])
    run.requests = [a, b]
    run.stream_ready()
    assert streamer.columns == [[4, 6]]  # column 1 waits for row 1
    b.finished = True
    run.stream_ready()
    assert streamer.columns == [[4, 6], [5, PAD]]  # a finished row gives pads
    run.stream_ready()
    assert len(streamer.columns) == 2 and run.streamed == 2


def test_stream_ready_stops_at_the_common_length():
    streamer = Streamer()
    run = make_run(streamer=streamer)
    run.requests, run.length = [Row(0, [4, 5, 6]), Row(1, [7, 8, 9])], 2
    run.stream_ready()
    assert streamer.columns == [[4, 7], [5, 8]]


def test_result_pads_rows_that_stopped_early_and_cuts_at_the_common_length():
    run = make_run()
    run.requests = [Row(0, [4, EOS]), Row(1, [3, 3, 3])]
    sequences = run.result()
    assert sequences.tolist() == [[5, 6, 7, 4, EOS, PAD], [0, 8, 9, 3, 3, 3]]
    run.length = 2
    assert run.result().tolist() == [[5, 6, 7, 4, EOS], [0, 8, 9, 3, 3]]


def test_result_as_a_dict():
    run = make_run(return_dict_in_generate=True, output_scores=True)
    run.requests = [Row(0, [4]), Row(1, [3])]
    run.scores = [[torch.ones(VOCAB)], [torch.zeros(VOCAB)]]
    out = run.result()
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"
    assert out.sequences.tolist() == [[5, 6, 7, 4], [0, 8, 9, 3]]
    assert len(out.scores) == 1 and out.scores[0].shape == (2, VOCAB) and out.logits is None
    assert out.past_key_values is None  # no engine ran: no snapshots


# ---- one run on an engine -------------------------------------------------------------------------------------
def test_run_on_an_engine_matches_hf_streams_every_column_and_pads_after_eos(one_torch_thread):
    model = cached_model("llama")
    ids, mask = left_padded_batch([5, 3], vocab=model.config.vocab_size, seed=3)
    width, max_length = ids.shape[1], ids.shape[1] + 4
    first = model.generate(ids, attention_mask=mask, max_length=max_length, do_sample=False, pad_token_id=PAD)
    eos = int(first[1, width + 1])  # row 1's second new token: with it as EOS, that row stops there
    hf = model.generate(ids, attention_mask=mask, max_length=max_length, do_sample=False, pad_token_id=PAD,
                        eos_token_id=eos)
    streamer = Streamer()
    run = GenerateRun(model, ids, mask, config(max_length, eos=eos), LogitsProcessorList(),
                      StoppingCriteriaList([MaxLengthCriteria(max_length), EosTokenCriteria(torch.tensor([eos]))]),
                      streamer)
    run.run(Engine(model, None, run.engine_config(None)))
    sequences = run.result()
    assert sequences.tolist() == hf.tolist()
    assert PAD in sequences[1, width:].tolist()  # row 1 was padded after its EOS
    assert streamer.ended and streamer.columns == sequences[:, width:].t().tolist()
