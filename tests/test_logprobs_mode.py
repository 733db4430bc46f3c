"""`SamplingParams.logprobs_mode`: the model's own distribution ("raw_logprobs", the default) or the one each token
was drawn from ("processed_logprobs": after penalties, temperature and truncation; what transformers' continuous
batching reports, and what hf_paged's take-over of it returns)."""
from __future__ import annotations

import pytest
import torch

from hf_paged.sampling import Sampler, SamplingParams


def sample(logits, params, history=None):
    rows = logits.shape[0]
    return Sampler(torch.device("cpu"), seed=0)(logits, params, history or [[] for _ in range(rows)],
                                                [[] for _ in range(rows)], [None] * rows, [[] for _ in range(rows)])


def test_processed_logprobs_follow_the_penalty_temperature_and_truncation():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    history = [[int(logits[0].argmax())], [], []]
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2, logprobs_mode=mode)
              for mode in ("raw_logprobs", "processed_logprobs")]
    params.append(SamplingParams(temperature=0.5, top_k=4, seed=3, logprobs=0, logprobs_mode="processed_logprobs"))
    rows = torch.stack([logits[0], logits[0], logits[2]])
    out = sample(rows, params, [history[0], history[0], []])
    raw = rows.log_softmax(-1)
    penalized = rows[0].clone()
    seen = history[0][0]
    penalized[seen] = penalized[seen] / 2.0 if penalized[seen] > 0 else penalized[seen] * 2.0
    token = out.token_ids[0]
    assert out.token_ids[0] == out.token_ids[1] == int(penalized.argmax())
    assert out.logprobs[0][token] == pytest.approx(float(raw[0, token]), abs=1e-5)
    assert out.logprobs[1][token] == pytest.approx(float(penalized.log_softmax(-1)[token]), abs=1e-5)
    assert len(out.logprobs[1]) == 2 and set(out.logprobs[1]) == set(penalized.topk(2).indices.tolist())
    scaled = rows[2] / 0.5
    kept = scaled.topk(4).indices
    truncated = torch.full_like(scaled, float("-inf"))
    truncated[kept] = scaled[kept]
    assert out.token_ids[2] in kept.tolist()
    assert out.logprobs[2][out.token_ids[2]] == pytest.approx(float(truncated.log_softmax(-1)[out.token_ids[2]]),
                                                             abs=1e-5)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs=1, logprobs_mode="processed").validate()


def test_transformers_manager_takeover_asks_for_processed_logprobs():
    from transformers import GenerationConfig

    from hf_paged.integrations.cb_params import sampling_params

    params = sampling_params(GenerationConfig(do_sample=True, temperature=0.7), model=None)
    assert params.logprobs == 0 and params.logprobs_mode == "processed_logprobs"
