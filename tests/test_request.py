"""request.py: a request's stop rules (their order, min_tokens), its snapshot / restore, its positions with HF's
right padding, and finding a stop string the newest token completes."""
import pytest

from hf_paged.request import (Request, ParentRequest, RequestStatus, apply_stop_rules, find_stop_string,
                              stop_string_start)
from hf_paged.sampling import SamplingParams

EOS = 2


def make_request(prompt=(5, 6, 7), **params):
    group = ParentRequest("r", 0, None, list(prompt))
    request = Request(group, list(prompt), SamplingParams(**params), eos_token_ids=(EOS,))
    group.samples.append(request)
    return request


def test_stop_tokens_and_eos_are_banned_and_ignored_until_min_tokens():
    request = make_request(min_tokens=2, stop_token_ids=[9], max_tokens=10)
    assert sorted(request.banned_token_ids()) == [EOS, 9]
    apply_stop_rules(request, 9, False, None, None)
    assert not request.is_finished and sorted(request.banned_token_ids()) == [EOS, 9]
    apply_stop_rules(request, 4, False, None, None)
    assert request.banned_token_ids() == []
    apply_stop_rules(request, 9, False, None, None)
    assert (request.finish_reason, request.stop_reason) == ("stop", 9)
    assert request.all_token_ids == [5, 6, 7, 9, 4, 9]


def test_eos_stops_unless_ignored_and_lengths_end_with_length():
    request = make_request(max_tokens=5)
    apply_stop_rules(request, EOS, False, None, None)
    assert request.finish_reason == "stop" and request.stop_reason is None
    ignoring = make_request(max_tokens=2, ignore_eos=True)
    apply_stop_rules(ignoring, EOS, False, None, None)
    apply_stop_rules(ignoring, EOS, False, None, None)
    assert ignoring.finish_reason == "length"
    at_model_len = make_request(max_tokens=50)
    apply_stop_rules(at_model_len, 4, False, 4, None)
    assert at_model_len.finish_reason == "length"


def test_a_hooks_stop_comes_first_and_a_failing_tokenizer_ends_only_this_request():
    hooked = make_request(max_tokens=1, stop_token_ids=[4])
    apply_stop_rules(hooked, 4, True, None, None)
    assert hooked.finish_reason == "stop" and hooked.stop_reason is None  # the hook's stop, not the stop token

    def broken(ids):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad")

    request = make_request(stop=["x"], max_tokens=5)
    apply_stop_rules(request, 4, False, None, broken)
    assert request.finish_reason == "error" and "checking stop strings failed" in request.error


def test_restore_puts_back_what_snapshot_saw():
    request = make_request(max_tokens=5, logprobs=0)
    request.logprobs = []
    request.append_token(4)
    saved = request.snapshot()
    request.status, request.num_computed_tokens = RequestStatus.RUNNING, 4
    request.block_table = [3, 4]
    request.append_token(8)
    request.logprobs.append({8: -0.1})
    request.block_hashes.append(b"k")
    request.finish("length")
    request.restore(saved)
    assert request.output_token_ids == [4] and request.all_token_ids == [5, 6, 7, 4]
    assert request.status is RequestStatus.WAITING and request.block_tables == [] and request.logprobs == []
    assert request.block_hashes == [] and request.finish_reason is None and request.num_computed_tokens == 0


def test_outputs_after_a_right_padded_prompt_continue_from_the_first_query():
    request = make_request(prompt=(5, 6, 7, 0, 0))
    request.first_query = (7, 2)  # HF samples the first output from the last real token, at position 2
    assert request.position_shift == -2 and request.needs_first_query
    assert list(request.positions(0, 7)) == [0, 1, 2, 3, 4, 3, 4]
    request.append_token(4)
    assert not request.needs_first_query


def test_stop_string_start_finds_the_occurrence_the_last_token_completed():
    pieces = ["ab", "X", "cd", "X"]

    def detokenize(ids):
        return "".join(pieces[i] for i in ids)

    assert stop_string_start([0, 1, 2, 3], "X", detokenize) == 5  # not the earlier one at 2


@pytest.mark.parametrize("pieces, stops, expected", [
    (["ab", "c", "de"], ["cd"], "cd"),  # across tokens
    (["x"] * 50 + ["st", "op"], ["stop"], "stop"),
    (["", "", "", "", "", "", "", "", "", "s", "top"], ["stop"], "stop"),  # empty tokens: the tail grows
    (["abc"], ["zz"], None),
])
def test_find_stop_string_on_token_pieces(pieces, stops, expected):
    def detokenize(ids):
        return "".join(pieces[i] for i in ids)

    assert find_stop_string(list(range(len(pieces))), stops, detokenize) == expected
