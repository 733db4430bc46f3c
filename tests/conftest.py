"""Shared helpers: parity with HF generate on tiny random-weight models (built from configs, no downloads)."""
from __future__ import annotations

import functools

import pytest
import torch

import hf_paged  # noqa: F401  (registers the take-over)
from hf_paged.integrations.generate_run import GenerateRun
from hf_paged.tiny import tiny_model

MARGIN = 1e-3  # a divergence is forgiven only where HF's own top-2 logit margin was below this
FORGIVEN: list[str] = []


@functools.lru_cache(maxsize=None)
def cached_model(arch: str, **overrides):
    return tiny_model(arch, **overrides)


@pytest.fixture
def llama():
    return cached_model("llama")


@pytest.fixture
def engine_runs(monkeypatch):
    """Records every GenerateRun that actually ran on the engine."""
    runs = []
    original = GenerateRun.run

    def spy(self, engine):
        runs.append(self)
        self.engine = engine  # for tests that check how the engine scheduled the call
        return original(self, engine)

    monkeypatch.setattr(GenerateRun, "run", spy)
    return runs


def left_padded_batch(lengths: list[int], vocab: int = 256, seed: int = 0, pad: int = 0):
    """Random prompts (tokens 3..vocab-1, so no BOS/EOS/PAD inside) left-padded into one batch."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask


def assert_same_as_hf(model, ids, mask, paged_kwargs=None, **gen_kwargs):
    """Run HF generate and the paged take-over on the same inputs and compare token for token.

    A row may differ only after a step where HF's own top-2 logit margin was < MARGIN (counted in FORGIVEN).
    Returns the paged output.
    """
    ref = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **gen_kwargs)
    out = model.generate(ids, attention_mask=mask, cache_implementation="paged", **(paged_kwargs or {}), **gen_kwargs)
    expected = ref.sequences
    assert out.shape == expected.shape, f"shape {tuple(out.shape)} != HF {tuple(expected.shape)}"
    prompt_len = ids.shape[1]
    for row in range(expected.shape[0]):
        diff = (out[row] != expected[row]).nonzero()
        if len(diff) == 0:
            continue
        first = int(diff[0])
        assert first >= prompt_len, f"row {row}: prompt changed at {first}"
        top2 = ref.logits[first - prompt_len][row].topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < MARGIN, (f"row {row} diverges at new token {first - prompt_len} where HF's margin was "
                                 f"{margin:.4f}:\npaged {out[row].tolist()}\nHF    {expected[row].tolist()}")
        FORGIVEN.append(f"row {row} step {first - prompt_len} margin {margin:.2e}")
    return out


def pytest_terminal_summary(terminalreporter):
    if FORGIVEN:
        terminalreporter.write_line(f"hf_paged parity: {len(FORGIVEN)} divergence(s) forgiven (HF top-2 margin < "
                                    f"{MARGIN}): {FORGIVEN}")
