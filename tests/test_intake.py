"""engine/intake.py as functions (the whole table through LLM is test_bad_input.py): prompt and parameter forms,
tokenizing, and the limits a request must fit, every refusal naming the request by its index."""
import numpy as np
import pytest
import torch

from hf_paged.config import EngineConfig, InputTypeError
from hf_paged.engine.intake import (Limits, as_params_list, as_priorities, as_prompt_list, check_model_len,
                                    check_request, tokenize)
from hf_paged.sampling import SamplingParams


def test_one_prompt_becomes_a_list_of_one_and_a_2d_tensor_one_per_row():
    assert as_prompt_list("hi") == ["hi"] and as_prompt_list([4, 5]) == [[4, 5]]
    assert as_prompt_list({"prompt": "x"}) == [{"prompt": "x"}]
    assert len(as_prompt_list(torch.ones(3, 2, dtype=torch.long))) == 3
    assert as_prompt_list(p for p in ([1], [2])) == [[1], [2]]  # any iterable, read once
    for bad in (None, b"bytes", 5, torch.ones(1, 1, 1)):
        with pytest.raises(InputTypeError):
            as_prompt_list(bad)


def test_params_and_priorities_one_per_prompt():
    shared = SamplingParams(max_tokens=3)
    assert as_params_list(shared, 2) == [shared, shared]
    assert as_params_list([None, {"max_tokens": 5}], 2)[1].max_tokens == 5
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        as_params_list([shared], 2)
    with pytest.raises(ValueError, match=r"request 0: unknown sampling parameter\(s\) \['max_token'\]"):
        as_params_list([{"max_token": 5}], 1)
    assert as_priorities(None, 2) == [0, 0] and as_priorities((3, np.int64(1)), 2) == [3, 1]
    with pytest.raises(InputTypeError, match="request 1: priority must be an integer"):
        as_priorities([1, 2.5], 2)


def test_tokenize_accepts_every_form_and_names_the_request():
    class Tok:
        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    assert tokenize(Tok(), "ab", 0) == [97, 98] == tokenize(None, {"prompt_token_ids": [97, 98]}, 0)
    assert tokenize(None, np.array([1, 2]), 0) == [1, 2] == tokenize(None, torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match="request 3: a text prompt needs a tokenizer"):
        tokenize(None, "ab", 3)
    with pytest.raises(InputTypeError, match="request 2: token ids must be integers; position 1 holds float"):
        tokenize(None, [1, 2.0], 2)
    with pytest.raises(InputTypeError, match="use LLM.chat"):
        tokenize(None, [{"role": "user", "content": "hi"}], 0)


def test_check_request_refuses_what_can_never_be_served():
    config = EngineConfig(block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False)
    limits = Limits(vocab_size=10, max_model_len=20, num_blocks=4, config=config)
    check_request(limits, 0, [1, 2], SamplingParams(max_tokens=14))  # 16 tokens: fits everything exactly
    cases = [([], {}, "the prompt is empty"), ([10], {}, r"token ids \[10\] are outside"),
             ([1], {"stop_token_ids": [12]}, "stop_token_ids"), ([1], {"max_tokens": 20}, "maximum length 20"),
             ([1] * 17, {"max_tokens": 1}, "can never fit the KV pool"),
             ([1], {"stop": ["x"]}, "need a tokenizer")]
    for tokens, params, message in cases:
        with pytest.raises(ValueError, match="^request 7: .*" + message):
            check_request(limits, 7, tokens, SamplingParams(**params), has_tokenizer=False)
    roomy = Limits(vocab_size=10, max_model_len=None, num_blocks=100, config=config)
    with pytest.raises(ValueError, match="exceed max_num_batched_tokens"):
        check_request(roomy, 0, [1] * 17, SamplingParams(max_tokens=1))


def test_max_model_len_within_the_position_table():
    check_model_len(EngineConfig(max_model_len=32), 32)
    check_model_len(EngineConfig(), 32)
    with pytest.raises(ValueError, match="max_model_len=64 exceeds"):
        check_model_len(EngineConfig(max_model_len=64), 32)
