"""`pipeline("text-generation")` with "paged" gives the same texts as without it and runs the whole input as ONE
engine run (a generator as it comes); options one engine run cannot reproduce fall back to HF's batches, whose
generate calls still run on the engine (the pipeline passes `input_ids=` as a keyword)."""
from __future__ import annotations

import logging
import string

import pytest
import torch
from transformers import PreTrainedTokenizerFast, pipeline

import hf_paged
from hf_paged.engine import Engine
from hf_paged.integrations.generate_run import GenerateRun
from hf_paged.tiny import tiny_model

PROMPTS = ["abc", "helloWorld", "x", "pagedAttention42"]  # 4 lengths: two batches of 2, both left-padded


def make_tokenizer():
    """Character-level tokenizer over the tiny vocabulary: <pad>=0, <s>=1, </s>=2, one character per other id."""
    from tokenizers import Tokenizer, decoders, models

    chars = string.ascii_letters + string.digits + "".join(chr(0x100 + k) for k in range(253 - 62))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + k for k, c in enumerate(chars)}}
    core = Tokenizer(models.BPE(vocab, merges=[], unk_token="<pad>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def engine_rows(monkeypatch):
    """Batch size of every generate call that ran on the engine."""
    rows = []
    original = GenerateRun.run

    def spy(self, engine):
        rows.append(len(self.rows))
        return original(self, engine)

    monkeypatch.setattr(GenerateRun, "run", spy)
    return rows


def texts(outputs):
    return [out[0]["generated_text"] for out in outputs]


def runs(engines) -> list[int]:
    """Requests given to each engine that ran."""
    return [count for _, count in engines.values()]


def test_call_kwarg(model, tok, engine_rows, engines, one_torch_thread):
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=2)
    ref = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False))
    assert not engine_rows and not engines
    out = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False, cache_implementation="paged"))
    assert engine_rows == [] and runs(engines) == [4], "the pipeline did not run as one engine run"
    assert out == ref
    assert all(len(t) == len(p) + 8 for t, p in zip(out, PROMPTS))  # one character per new token


def test_construction_kwarg(model, tok, engine_rows, engines, one_torch_thread):
    ref = texts(pipeline("text-generation", model=model, tokenizer=tok, batch_size=2)(
        PROMPTS, max_new_tokens=8, do_sample=False))
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=2, cache_implementation="paged")
    out = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False))
    assert engine_rows == [] and runs(engines) == [4]
    assert out == ref


def test_ragged_eos_texts(model, tok, engine_rows, engines, one_torch_thread):
    """An EOS that one prompt of a batch reaches mid-way: its text stops there, its batch-mate's does not."""
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=2)
    free = texts(pipe(PROMPTS[:2], max_new_tokens=8, do_sample=False, return_full_text=False))
    eos = tok.convert_tokens_to_ids(free[0][3])
    assert free[0][3] not in free[1][:4]
    ref = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False, eos_token_id=eos, return_full_text=False))
    assert len(ref[0]) < 8 <= len(ref[1]), ref
    out = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False, eos_token_id=eos, return_full_text=False,
                     cache_implementation="paged"))
    assert engine_rows == [] and runs(engines) == [4]
    assert out == ref


# ---- one engine run for the whole pipeline call ------------------------------------------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}A{% endif %}")
MANY = [string.ascii_letters[k % 40:][: 3 + (7 * k) % 23] for k in range(12)]  # 12 prompts of 3-25 characters


@pytest.fixture
def engines(monkeypatch):
    """Every Engine that stepped, with the number of requests it was given (a spy: the real methods run)."""
    seen: dict[int, list] = {}
    add, step = Engine.add_request, Engine.step

    def add_spy(self, *args, **kwargs):
        seen.setdefault(id(self), [self, 0])[1] += 1
        return add(self, *args, **kwargs)

    def step_spy(self):
        seen.setdefault(id(self), [self, 0])
        return step(self)

    monkeypatch.setattr(Engine, "add_request", add_spy)
    monkeypatch.setattr(Engine, "step", step_spy)
    return seen


def hf_reference(model, tok, inputs, **kwargs):
    """HF's own pipeline output (hf_paged disabled for the call, restored after)."""
    hf_paged.disable()
    try:
        return pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)(inputs, **kwargs)
    finally:
        hf_paged.enable()


def test_whole_list_is_one_engine_run(model, tok, engine_rows, engines, one_torch_thread):
    ref = hf_reference(model, tok, MANY, max_new_tokens=6, do_sample=False)
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)
    out = pipe(MANY, max_new_tokens=6, do_sample=False, cache_implementation="paged")
    assert out == ref
    assert engine_rows == [], "the pipeline ran batch by batch"
    assert runs(engines) == [len(MANY)], "not one engine run for the whole list"
    next(iter(engines.values()))[0].check_idle()


def test_model_generation_config_asks_for_paged(tok, engine_rows, engines, one_torch_thread):
    model = tiny_model("llama")
    ref = hf_reference(model, tok, MANY, max_new_tokens=5, do_sample=False, return_full_text=False)
    model.generation_config.cache_implementation = "paged"
    out = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)(
        MANY, max_new_tokens=5, do_sample=False, return_full_text=False)
    assert out == ref
    assert engine_rows == [] and runs(engines) == [len(MANY)]


def test_generator_is_consumed_as_it_comes(model, tok, engines, one_torch_thread):
    """With one sequence at a time the engine holds at most 2 prompts: the first output comes before the generator
    is read to its end; the outputs are HF's, in order."""
    ref = hf_reference(model, tok, MANY[:6], max_new_tokens=4, do_sample=False)
    pulled = []

    def source():
        for prompt in MANY[:6]:
            pulled.append(prompt)
            yield prompt

    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)
    results = pipe(source(), max_new_tokens=4, do_sample=False, cache_implementation="paged",
                   cache_config={"max_num_seqs": 1})
    first = next(results)
    assert len(pulled) <= 3, f"the generator was read ahead to {len(pulled)} items"
    assert [first, *results] == ref
    assert runs(engines) == [6]


def test_key_dataset_and_abandoned_iterator_frees_memory(model, tok, engines, one_torch_thread):
    from transformers.pipelines.pt_utils import KeyDataset

    data = KeyDataset([{"text": p} for p in MANY[:5]], "text")
    ref = hf_reference(model, tok, MANY[:5], max_new_tokens=4, do_sample=False)
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)
    assert list(pipe(data, max_new_tokens=4, do_sample=False, cache_implementation="paged")) == ref
    results = pipe(data, max_new_tokens=40, do_sample=False, cache_implementation="paged")
    next(results)
    results.close()  # abandoned mid-run: what was queued is aborted
    for engine, _ in engines.values():
        engine.check_idle()


def test_chat_messages_and_return_full_text(model, tok, one_torch_thread):
    chat_tok = make_tokenizer()
    chat_tok.chat_template = CHAT_TEMPLATE
    chats = [[{"role": "user", "content": p}] for p in MANY[:5]]
    chats.append([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "pre"}])  # prefill
    for full in (True, False):
        ref = hf_reference(model, chat_tok, chats, max_new_tokens=5, do_sample=False, return_full_text=full)
        pipe = pipeline("text-generation", model=model, tokenizer=chat_tok, batch_size=4)
        out = pipe(chats, max_new_tokens=5, do_sample=False, return_full_text=full, cache_implementation="paged")
        assert out == ref


def test_num_return_sequences_when_sampling(model, tok, engines, one_torch_thread):
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4, cache_implementation="paged")
    torch.manual_seed(0)
    out = pipe(MANY[:4], max_new_tokens=5, do_sample=True, num_return_sequences=3, eos_token_id=None)
    torch.manual_seed(0)  # reproducible like HF's sampling
    assert pipe(MANY[:4], max_new_tokens=5, do_sample=True, num_return_sequences=3, eos_token_id=None) == out
    assert [len(group) for group in out] == [3] * 4
    for prompt, group in zip(MANY, out):  # 5 new tokens each (special ones, which decode to nothing, may be drawn)
        assert all(o["generated_text"].startswith(prompt) and len(o["generated_text"]) <= len(prompt) + 5
                   for o in group)
    assert len({o["generated_text"] for group in out for o in group}) > 4, "the samples are not drawn independently"
    assert runs(engines) == [4, 4]
    with pytest.raises(ValueError, match="num_return_sequences"):  # HF's own refusal without sampling
        pipe(MANY[:4], max_new_tokens=5, do_sample=False, num_return_sequences=2)


def test_unsupported_options_fall_back_to_hf_batches(model, tok, engine_rows, caplog, one_torch_thread):
    ref = hf_reference(model, tok, MANY[:4], max_new_tokens=5, do_sample=False, repetition_penalty=1.3)
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=2)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        out = pipe(MANY[:4], max_new_tokens=5, do_sample=False, repetition_penalty=1.3, cache_implementation="paged")
    assert out == ref
    assert engine_rows == [2, 2]  # HF's batches, each generate call on the engine
    assert "repetition_penalty" in caplog.text and "batch by batch" in caplog.text
