"""model/self_attending.py: which attention modules get a paged forward of their own (they compute attention
themselves, outside transformers' AttentionInterface), and what such a forward refuses. Greedy parity of bloom, mpt
and gpt_neo with HF is in test_alibi_chunked_models.py."""
import pytest
import torch
from test_alibi_chunked_models import tiny

from hf_paged import LLM, SamplingParams
from hf_paged.model.paged_forward import UnsupportedAttention
from hf_paged.model.self_attending import SELF_ATTENDING, self_attending_modules


@pytest.mark.parametrize("name, attention", [("bloom", "BloomAttention"), ("mpt", "MptAttention"),
                                             ("gpt_neo", "GPTNeoSelfAttention")])
def test_each_layers_attention_module_is_found(name, attention):
    model = tiny(name)
    found = self_attending_modules(model)
    assert [type(m).__name__ for m, _ in found] == [attention] * 2
    assert all(factory is SELF_ATTENDING[attention] for _, factory in found)


def test_models_whose_attention_goes_through_the_interface_have_none(llama):
    assert self_attending_modules(llama) == []


def test_bloom_slow_but_exact_tensor_parallel_attention_is_refused(one_torch_thread):
    model = tiny("bloom", pretraining_tp=2, slow_but_exact=True)
    with pytest.raises(ValueError, match="slow_but_exact"):
        LLM(model).generate([[5, 9, 17]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert issubclass(UnsupportedAttention, ValueError)
