"""`pipeline("text-generation")` with `cache_implementation="paged"` gives the same texts as without it,
and really runs on the engine (the pipeline passes `input_ids=` as a keyword)."""
from __future__ import annotations

import string

import pytest
from transformers import PreTrainedTokenizerFast, pipeline

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


def test_call_kwarg(model, tok, engine_rows):
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=2)
    ref = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False))
    assert not engine_rows
    out = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False, cache_implementation="paged"))
    assert engine_rows == [2, 2], "the pipeline's generate calls did not run on the engine"
    assert out == ref
    assert all(len(t) == len(p) + 8 for t, p in zip(out, PROMPTS))  # one character per new token


def test_construction_kwarg(model, tok, engine_rows):
    ref = texts(pipeline("text-generation", model=model, tokenizer=tok, batch_size=2)(
        PROMPTS, max_new_tokens=8, do_sample=False))
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=2, cache_implementation="paged")
    out = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False))
    assert engine_rows == [2, 2]
    assert out == ref


def test_ragged_eos_texts(model, tok, engine_rows):
    """An EOS that one prompt of a batch reaches mid-way: its text stops there, its batch-mate's does not."""
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=2)
    free = texts(pipe(PROMPTS[:2], max_new_tokens=8, do_sample=False, return_full_text=False))
    eos = tok.convert_tokens_to_ids(free[0][3])
    assert free[0][3] not in free[1][:4]
    ref = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False, eos_token_id=eos, return_full_text=False))
    assert len(ref[0]) < 8 <= len(ref[1]), ref
    out = texts(pipe(PROMPTS, max_new_tokens=8, do_sample=False, eos_token_id=eos, return_full_text=False,
                     cache_implementation="paged"))
    assert engine_rows == [2, 2]
    assert out == ref
