"""Shared helpers for the generate take-over tests: tiny models, batches, an offline tokenizer, and a
fixture that records every engine run (a silent fall-back to HF's loop must not pass for parity)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import (PreTrainedTokenizerFast)

from hf_paged.tiny import tiny_model

PAD, EOS = 0, 2
MODELS: dict[str, torch.nn.Module] = {}


def model_for(arch: str = "llama"):
    if arch not in MODELS:
        # gpt2 ties its head to the input embeddings, so sharpening would make it echo the last token forever
        MODELS[arch] = tiny_model(arch, **({"tie_word_embeddings": False} if arch == "gpt2" else {}))
    return MODELS[arch]


def batch(lengths=(3, 7, 12), seed=0, side="left"):
    """Random prompts (tokens 3..255: no PAD/BOS/EOS inside) padded into one batch with their mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, cols] = torch.randint(3, 256, (n,), generator=gen)
        mask[row, cols] = 1
    return ids, mask


def make_tokenizer(padding_side="left"):
    """A character-level tokenizer over the tiny vocabulary (offline): <pad>=0, <s>=1, </s>=2, then one
    character per id (letters, digits, then Latin-extended letters). StopStringCriteria needs real strings."""
    import string

    from tokenizers import Tokenizer, decoders, models

    chars = string.ascii_letters + string.digits + "".join(chr(0x100 + k) for k in range(253 - 62))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + k for k, c in enumerate(chars)}}
    core = Tokenizer(models.BPE(vocab, merges=[], unk_token="<pad>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side=padding_side)


def state(model):
    return (model.config._attn_implementation, model.config.to_dict(), model.generation_config.to_dict())


@contextmanager
def on_engine(runs, model, expected=1):
    """The block must run `expected` generate calls on the engine and leave the model's configs untouched,
    also when it raises."""
    before, snapshot = len(runs), state(model)
    try:
        yield
    finally:
        assert state(model) == snapshot, "generate changed the model's config / generation_config"
        assert len(runs) == before + expected, f"{len(runs) - before} engine runs, expected {expected}"


def paged(model, runs, *args, **kwargs):
    with on_engine(runs, model):
        return model.generate(*args, cache_implementation="paged", **kwargs)


def ragged_eos(model, ids, mask, steps=12, **kwargs):
    """A token HF generates mid-way for one row but later (or never) for another: rows finish at different
    steps. Returns (eos, HF's free-running new tokens)."""
    new = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                         **kwargs)
    new = new[:, ids.shape[1]:]

    def first(row, token):
        hits = (new[row] == token).nonzero()
        return int(hits[0]) if len(hits) else steps

    for row in range(len(new)):
        for step in range(1, steps - 3):
            token = int(new[row, step])
            firsts = [first(r, token) for r in range(len(new))]
            if token != PAD and firsts[row] == step and max(firsts) > step + 1:
                return token, new
    raise AssertionError("no token suits a ragged finish; change the prompts")


def assert_ragged(out, prompt_len, eos):
    """The result really has rows finishing at different steps, followed by pads."""
    new = out[:, prompt_len:]
    ended = [int((row == eos).nonzero()[0]) if (row == eos).any() else None for row in new]
    assert any(e is not None and e < new.shape[1] - 1 for e in ended), f"no row ended early: {new.tolist()}"
    assert len(set(ended)) > 1, f"all rows ended together: {new.tolist()}"
    for row, e in zip(new, ended):
        if e is not None:
            assert (row[e + 1:] == PAD).all()
