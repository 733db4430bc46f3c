"""engine/outputs.py: what callers get back: text only for finished samples (or partial snapshots), cut before the
stop string that ended it, a decoding failure as an error of that output only, samples in order, timings."""
from hf_paged.engine.outputs import completion, parent_output
from hf_paged.request import Request, ParentRequest
from hf_paged.sampling import SamplingParams


def detokenize(ids):
    return "".join(chr(97 + t) for t in ids)


def make_group(n=2, **params):
    group = ParentRequest("g", 0, "p", [1, 2])
    for i in range(n):
        group.samples.append(Request(group, [1, 2], SamplingParams(**params), sample_index=i))
    return group


def test_text_is_decoded_for_finished_samples_and_cut_before_the_stop_string():
    request = make_group(1, stop=["cd"]).samples[0]
    for t in (0, 1, 2, 3):  # "abcd"
        request.append_token(t)
    assert completion(request, detokenize).text is None  # unfinished: no text
    assert completion(request, detokenize, partial=True).text == "abcd"
    request.finish("stop")
    request.stop_reason = "cd"
    out = completion(request, detokenize)
    assert (out.text, out.token_ids, out.finish_reason) == ("ab", [0, 1, 2, 3], "stop")


def test_a_failing_tokenizer_makes_that_output_an_error_with_its_tokens():
    request = make_group(1).samples[0]
    request.append_token(3)
    request.finish("length")

    def broken(ids):
        raise ValueError("no such token")

    out = completion(request, broken)
    assert (out.text, out.token_ids, out.finish_reason) == (None, [3], "error")
    assert out.error == "decoding the output failed: ValueError: no such token"


def test_parent_output_orders_samples_and_reports_finished_and_metrics():
    group = make_group(3)
    first, second, third = group.samples
    for request in (third, first):
        request.append_token(0)
        request.finish("length")
    out = parent_output(group, [third, first], detokenize)
    assert [c.index for c in out.outputs] == [0, 2] and out.finished and out.num_cached_tokens == 0
    assert out.metrics["latency_s"] is None and out.metrics["time_to_first_token_s"] >= 0  # one sample still runs
    second.append_token(1)
    second.finish("stop")
    whole = parent_output(group, None, detokenize)
    assert [c.text for c in whole.outputs] == ["a", "b", "a"] and whole.metrics["latency_s"] >= 0
