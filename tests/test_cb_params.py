"""integrations/cb_params.py: transformers' continuous-batching settings as hf_paged engine options and
SamplingParams, and what hf_paged leaves to transformers' own manager."""
from types import SimpleNamespace

import pytest
from transformers import GenerationConfig

from hf_paged.integrations.cb_params import engine_options, reason_to_decline, request_params, sampling_params

from conftest import cached_model


def test_engine_options_keep_the_pools_tokens_and_size_a_hinted_pool_to_the_workload():
    cb = SimpleNamespace(block_size=32, num_blocks=10, max_batch_tokens=256, max_requests_per_batch=4,
                         allow_block_sharing=False, seed=7)
    assert engine_options(cb) == {"block_size": 32, "num_blocks": 10, "max_num_batched_tokens": 256,
                                  "max_num_seqs": 4, "enable_prefix_caching": False, "seed": 7}
    assert engine_options(SimpleNamespace(num_blocks=10, page_size=64)) == {"num_blocks": 40}  # 640 tokens of 16
    hints = SimpleNamespace(num_requests=3, max_prompt_length=20, max_generated_length=13)
    assert engine_options(None, hints) == {"num_blocks": 9, "hinted": 9}  # 3 requests x ceil(33 / 16) blocks
    assert engine_options(None) == {}


def test_sampling_params_follow_the_generation_config():
    greedy = sampling_params(GenerationConfig(repetition_penalty=1.3, min_new_tokens=2), None)
    assert (greedy.temperature, greedy.repetition_penalty, greedy.min_tokens, greedy.logprobs) == (0.0, 1.3, 2, 0)
    sampled = sampling_params(GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9), None)
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (0.7, 5, 0.9)
    plain = sampling_params(GenerationConfig(do_sample=True, temperature=0.7, top_k=5), None, plain=True)
    assert (plain.temperature, plain.top_k) == (1.0, 0)


def test_request_params_set_length_eos_and_the_keywords_a_greedy_request_may_take():
    config = GenerationConfig(max_length=30)
    base = sampling_params(config, None)
    params = request_params(base, config, prompt_len=12, max_new_tokens=None, eos_token_id=[2, -1],
                            keywords={"temperature": 0.5, "repetition_penalty": 1.2}, n=2)
    assert (params.max_tokens, params.stop_token_ids, params.n) == (18, [2], 2)
    assert params.temperature == 0.0 and params.repetition_penalty == 1.2  # greedy stays greedy
    sampled = request_params(sampling_params(GenerationConfig(do_sample=True), None), config, 5, 4, None,
                             {"temperature": 0.5})
    assert (sampled.temperature, sampled.max_tokens, sampled.stop_token_ids) == (0.5, 4, [])
    with pytest.raises(ValueError, match=r"unknown logit_processor_kwargs \['typical_p'\]"):
        request_params(base, config, 5, 4, None, {"typical_p": 0.5})


def test_beam_search_and_unknown_processors_are_left_to_transformers():
    model = cached_model("llama")
    assert reason_to_decline(model, GenerationConfig(), None) is None
    assert reason_to_decline(model, GenerationConfig(num_beams=2), None) == "beam search (num_beams > 1)"
    assert "TypicalLogitsWarper" in reason_to_decline(model, GenerationConfig(do_sample=True, typical_p=0.5), None)
