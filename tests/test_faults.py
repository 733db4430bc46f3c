"""Fault injection: the model, a user hook or the tokenizer failing mid-run ends only what it must.

The contract (docs/reliability.md): every request ends exactly once (right tokens, or finish_reason="error" with a
message); an exception that propagates is the caller's own object; nobody else's tokens change; afterwards the
engine serves the next call correctly and holds nothing for ended requests (`check_idle`).
"""
import gc
import weakref
from contextlib import contextmanager

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_paged import LLM, RequestOutput, SamplingParams
from hf_paged.integrations import generate as takeover
from hf_paged.tiny import tiny_model

from conftest import cached_model, left_padded_batch

SYSTEM = list(range(30, 50))  # a shared prefix: prefix-cache hits between the victim and its neighbours
PROMPTS = [SYSTEM + [5, 6, 7], [8, 9, 10, 11] * 5, SYSTEM + [12], [13, 14]]
PARAMS = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=2, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=9, ignore_eos=True),
          SamplingParams(max_tokens=16, temperature=0.0, n=3, ignore_eos=True)]
# small pool, small chunks, swap: failures land while requests are chunked, preempted, swapped and forked
PRESSURED = dict(block_size=4, num_blocks=14, max_num_batched_tokens=16, preemption_mode="swap",
                 swap_space=1 << 20, attention_backend="torch")
POISON = 250  # an embedding row made NaN: only prompts holding this token go non-finite


class Boom(Exception):
    """The caller's own exception."""


def tokens(outputs):
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def model():
    return cached_model("llama", max_len=256)


@pytest.fixture(scope="module")
def expected(model):
    return tokens(LLM(model, attention_backend="torch").generate(PROMPTS, PARAMS, use_tqdm=False))


def assert_idle_and_serving(llm, expected):
    llm.engine.check_idle()
    assert not llm.engine.parents
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    llm.engine.check_idle()


@contextmanager
def last_layer_raising(model, at: int, error: Exception):
    """The model's last decoder layer raises `error` on its `at`-th call (after the other layers wrote their K/V)."""
    layer = model.model.layers[-1]
    original, calls = layer.forward, [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise error
        return original(*args, **kwargs)

    layer.forward = forward
    try:
        yield calls
    finally:
        del layer.forward


# ---- the model raising -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("at", [1, 3, 9])
def test_model_raising_in_generate_ends_that_call_only(model, expected, at):
    llm = LLM(model, **PRESSURED)
    error = Boom("forward failed")
    with last_layer_raising(model, at, error), pytest.raises(Boom) as caught:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert caught.value is error
    assert_idle_and_serving(llm, expected)
    assert llm.stats()["num_preemptions"] > 0


def step_until_done(llm, ended: dict) -> None:
    """Step until nothing is left, recording each sample's end (exactly once)."""
    while llm.has_unfinished_requests():
        for out in llm.step():
            for c in out.outputs:
                if c.finish_reason is not None:
                    assert (out.request_id, c.index) not in ended, "a sample finished twice"
                    ended[(out.request_id, c.index)] = c


@pytest.mark.parametrize("at", [2, 6, 15])
def test_model_raising_in_a_step_loop_loses_nothing(model, expected, at):
    """The failed step changed no request: stepping on finishes every request with the right tokens."""
    llm = LLM(model, **PRESSURED)
    ids = [llm.add_request(p, s, request_id=f"q{i}") for i, (p, s) in enumerate(zip(PROMPTS, PARAMS))]
    ended = {}
    error = Boom("forward failed")
    with last_layer_raising(model, at, error), pytest.raises(Boom) as caught:
        step_until_done(llm, ended)
    assert caught.value is error
    step_until_done(llm, ended)
    assert len(ended) == sum(s.n for s in PARAMS)
    assert all(c.finish_reason == "length" for c in ended.values())
    assert [[ended[(rid, i)].token_ids for i in range(s.n)] for rid, s in zip(ids, PARAMS)] == expected
    assert_idle_and_serving(llm, expected)


def test_model_raising_in_a_step_loop_then_abort_frees_everything(model, expected):
    llm = LLM(model, **PRESSURED)
    ids = [llm.add_request(p, s) for p, s in zip(PROMPTS, PARAMS)]
    with last_layer_raising(model, 4, Boom()), pytest.raises(Boom):
        while llm.has_unfinished_requests():
            llm.step()
    assert all(llm.abort(i) for i in ids if i in llm.engine.parents)
    assert_idle_and_serving(llm, expected)


def hf_reference(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, **kwargs)


@contextmanager
def recorded_engines(monkeypatch):
    """Weak references to the engines the generate take-over builds (they must not outlive the call)."""
    made = []

    class Recording(takeover.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(takeover, "Engine", Recording)
    yield made


def assert_model_left_as_found(model, made, ids, mask, attn, **kwargs):
    gc.collect()
    assert made and all(ref() is None for ref in made), "the failed call's engine is still alive"
    assert model.config._attn_implementation == attn
    assert torch.equal(model.generate(ids, attention_mask=mask, cache_implementation="paged", **kwargs),
                       hf_reference(model, ids, mask, **kwargs))


GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)


@pytest.fixture
def warm(model):
    """One paged generate first: the model check an engine runs once per model (probe.py) is done before the fault
    is injected, so the fault hits serving."""
    ids, mask = left_padded_batch([3])
    model.generate(ids, attention_mask=mask, cache_implementation="paged", **GEN)


@pytest.mark.parametrize("at", [1, 4])
def test_model_raising_in_paged_generate(model, warm, monkeypatch, at):
    ids, mask = left_padded_batch([5, 9, 3])
    attn = model.config._attn_implementation
    error = Boom("forward failed")
    with recorded_engines(monkeypatch) as made:
        with last_layer_raising(model, at, error), pytest.raises(Boom) as caught:
            model.generate(ids, attention_mask=mask, cache_implementation="paged", **GEN)
        assert caught.value is error
        del caught, error  # the exception's traceback holds the failed call's frames (and so its engine)
        assert_model_left_as_found(model, made, ids, mask, attn, **GEN)


# ---- user hooks in the generate take-over ------------------------------------------------------------------------
class RaisingProcessor(LogitsProcessor):
    def __init__(self, at, error):
        self.at, self.error, self.calls = at, error, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return scores


class RaisingCriterion(StoppingCriteria):
    def __init__(self, at, error):
        self.at, self.error, self.calls = at, error, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class RaisingStreamer:
    def __init__(self, at, error):
        self.at, self.error, self.calls = at, error, 0

    def put(self, value):
        self.calls += 1
        if self.calls == self.at:
            raise self.error

    def end(self):
        pass


@pytest.mark.parametrize("hook", ["logits_processor", "stopping_criteria", "streamer"])
def test_user_hook_raising_in_paged_generate(model, warm, monkeypatch, hook):
    ids, mask = left_padded_batch([4, 7])
    error = Boom(f"{hook} failed")
    extra = {"logits_processor": {"logits_processor": LogitsProcessorList([RaisingProcessor(3, error)])},
             "stopping_criteria": {"stopping_criteria": StoppingCriteriaList([RaisingCriterion(3, error)])},
             "streamer": {"streamer": RaisingStreamer(4, error)}}[hook]
    attn = model.config._attn_implementation
    with recorded_engines(monkeypatch) as made:
        with pytest.raises(Boom) as caught:
            model.generate(ids[:1] if hook == "streamer" else ids, attention_mask=mask[:1] if hook == "streamer"
                           else mask, cache_implementation="paged", **GEN, **extra)
        assert caught.value is error
        del caught, error, extra  # the exception's traceback holds the failed call's frames (and so its engine)
        assert_model_left_as_found(model, made, ids, mask, attn, **GEN)


# ---- non-finite logits in one row ---------------------------------------------------------------------------------
@contextmanager
def poisoned(model, token=POISON):
    weight = model.get_input_embeddings().weight
    saved = weight.data[token].clone()
    weight.data[token] = float("nan")
    try:
        yield
    finally:
        weight.data[token] = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_one_row_ends_only_its_request(dtype):
    """The victim shares a cached prefix with a neighbour and runs in the same steps as the others (chunked,
    preempted, swapped). Compared with the same engine's unpoisoned run: the victim alone ends with an error, the
    others' tokens are unchanged; its NaN blocks are never served again (the next clean run is exact)."""
    model = cached_model("llama", max_len=256) if dtype == torch.float32 else tiny_model("llama", dtype=dtype,
                                                                                         max_len=256)
    prompts = PROMPTS + [SYSTEM + [POISON, 7, 8, 9, 10, 11]]
    params = PARAMS + [SamplingParams(max_tokens=10, temperature=1.0, seed=1, n=2, ignore_eos=True)]
    llm = LLM(model, **PRESSURED)
    clean = tokens(llm.generate(prompts, params, use_tqdm=False))
    with poisoned(model):
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [c.finish_reason for c in outs[-1].outputs] == ["error", "error"]
    assert all("non-finite" in c.error for c in outs[-1].outputs)
    assert all(c.finish_reason == "length" and c.error is None for out in outs[:-1] for c in out.outputs)
    assert tokens(outs[:-1]) == clean[:-1]
    llm.engine.check_idle()
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == clean
    llm.engine.check_idle()


def test_nan_in_one_row_of_a_step_loop(model, expected):
    llm = LLM(model, **PRESSURED)
    with poisoned(model):
        ids = [llm.add_request(p, s) for p, s in zip(PROMPTS, PARAMS)]
        victim = llm.add_request([POISON, 3, 4], PARAMS[0])
        ended = {}
        step_until_done(llm, ended)
    assert ended.pop((victim, 0)).finish_reason == "error"
    assert [[ended[(rid, i)].token_ids for i in range(s.n)] for rid, s in zip(ids, PARAMS)] == expected
    assert_idle_and_serving(llm, expected)


# ---- the tokenizer raising ---------------------------------------------------------------------------------------
class FlakyTokenizer:
    """One character per token; `decode` raises KeyError on any token id in `bad`."""

    eos_token_id = None

    def __init__(self):
        self.bad: set[int] = set()

    def decode(self, token_ids, skip_special_tokens=True):
        if self.bad.intersection(token_ids):
            raise KeyError(f"cannot decode {sorted(self.bad.intersection(token_ids))}")
        return "".join(chr(97 + t % 26) for t in token_ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


@pytest.mark.parametrize("where", ["stop strings", "output text"])
def test_tokenizer_raising_ends_only_that_request(model, expected, where):
    """`decode` runs for stop strings after every token and for the text at the end; it failing for one request's
    tokens ends that request with an error (its tokens kept) and nobody else's."""
    tokenizer = FlakyTokenizer()
    llm = LLM(model, tokenizer=tokenizer, **PRESSURED)
    victim_params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                   stop=["never there"] if where == "stop strings" else [])
    prompts, params = PROMPTS + [[60, 61, 62]], PARAMS + [victim_params]
    clean = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(clean[:-1]) == expected
    victim_tokens = clean[-1].token_ids
    tokenizer.bad = {victim_tokens[5]} - {t for out in expected for sample in out for t in sample}
    assert tokenizer.bad, "pick a prompt whose output has a token no neighbour produces"
    for run in ("generate", "steps"):
        if run == "generate":
            outs = llm.generate(prompts, params, use_tqdm=False)
        else:
            for p, s, i in zip(prompts, params, range(len(prompts))):
                llm.add_request(p, s, request_id=str(i))
            ended = {}
            step_until_done(llm, ended)
            outs = [RequestOutput(str(i), None, p, [ended[(str(i), k)] for k in range(s.n)])
                    for i, (p, s) in enumerate(zip(prompts, params))]
        failed = outs[-1].outputs[0]
        assert failed.finish_reason == "error" and "KeyError" in failed.error and failed.text is None
        stop_at = victim_tokens.index(victim_tokens[5]) + 1  # the stop-string check fails on the first bad token
        assert failed.token_ids == (victim_tokens[:stop_at] if where == "stop strings" else victim_tokens)
        assert tokens(outs[:-1]) == expected
        assert [o.text for o in outs[:-1]] == [o.text for o in clean[:-1]]
        llm.engine.check_idle()
        assert not llm.engine.parents
    tokenizer.bad = set()
    assert [o.text for o in llm.generate(prompts, params, use_tqdm=False)] == [o.text for o in clean]
