"""integrations/cb_outputs.py: the background thread's side of the continuous-batching manager, on a stand-in
manager: requests go into the LLM (a refused one fails at once, naming why; a running id is refused), outputs come
back per sample under transformers' names, streamed or only when finished, and a request leaves when all its samples
have. (The manager through transformers' API is test_cb_manager.py's.)"""
import enum
from types import SimpleNamespace

from transformers import GenerationConfig

from hf_paged.integrations.cb_outputs import OutputBuilder
from hf_paged.integrations.cb_params import sampling_params


class Status(enum.Enum):
    DECODING, FINISHED, FAILED = range(3)


class LLM:
    def __init__(self):
        self.added, self.aborted = [], []

    def add_request(self, prompt, params, request_id):
        if not prompt:
            raise ValueError("request 0: the prompt is empty")
        self.added.append((request_id, params))

    def abort(self, request_id):
        self.aborted.append(request_id)


def manager(n=1):
    config = GenerationConfig(max_new_tokens=4, eos_token_id=2, do_sample=True)
    delivered = []
    return SimpleNamespace(llm=LLM(), generation_config=config, num_return_sequences=n, _live={},
                           _base_params=sampling_params(config, None), _deliver=delivered.append,
                           _output_class=SimpleNamespace, _status=Status, delivered=delivered)


def sample(index, tokens, reason=None, error=None):
    return SimpleNamespace(index=index, token_ids=tokens, finish_reason=reason, error=error,
                           logprobs=[{t: -0.5} for t in tokens])


def test_requests_go_in_with_their_params_and_refusals_fail_at_once():
    m = manager(n=2)
    builder = OutputBuilder(m)
    builder.add("a", [5, 6], None, False, False, None, {}, created=1.0)
    (request_id, params), = m.llm.added
    assert request_id == "a" and params.n == 2 and params.max_tokens == 4 and params.stop_token_ids == [2]
    assert m._live["a"]["names"] == ["a", "a__child#0"]
    builder.add("a", [7], None, False, False, None, {}, created=2.0)  # the id is running
    builder.add("b", [], None, False, False, None, {}, created=3.0)  # refused by the LLM
    assert [(o.request_id, o.status) for o in m.delivered] == [
        ("a", Status.FAILED), ("a__child#0", Status.FAILED), ("b", Status.FAILED), ("b__child#0", Status.FAILED)]
    assert "already running" in m.delivered[0].error and m.delivered[2].error == "request 0: the prompt is empty"


def test_outputs_are_delivered_when_finished_or_streamed_and_the_request_then_leaves():
    m = manager(n=2)
    builder = OutputBuilder(m)
    builder.add("a", [5], None, False, True, None, {}, created=1.0)
    builder.emit(SimpleNamespace(request_id="a", outputs=[sample(0, [7]), sample(1, [8])]))
    assert m.delivered == []  # not streaming: nothing until a sample finishes
    builder.emit(SimpleNamespace(request_id="a", outputs=[sample(0, [7, 9], "length"), sample(1, [8, 3])]))
    (first,) = m.delivered
    assert (first.request_id, first.generated_tokens, first.status, first.logprobs) == ("a", [7, 9], Status.FINISHED,
                                                                                         [-0.5, -0.5])
    assert len(first.timestamps) == 2 and "a" in m._live
    builder.emit(SimpleNamespace(request_id="a", outputs=[sample(1, [8, 3, 4], "error", "boom")]))
    assert (m.delivered[1].request_id, m.delivered[1].status, m.delivered[1].error) == (
        "a__child#0", Status.FAILED, "boom")
    assert "a" not in m._live


def test_streaming_delivers_every_step_and_cancel_stops_a_request():
    m = manager()
    builder = OutputBuilder(m)
    builder.add("s", [5], None, True, False, None, {}, created=1.0)
    builder.emit(SimpleNamespace(request_id="s", outputs=[sample(0, [7])]))
    assert m.delivered[0].status is Status.DECODING and m.delivered[0].timestamps is None
    builder.cancel("s")
    builder.emit(SimpleNamespace(request_id="s", outputs=[sample(0, [7, 8], "length")]))
    assert m.llm.aborted == ["s"] and len(m.delivered) == 1  # nothing more after the cancel
