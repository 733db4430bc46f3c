"""model/paged_forward.py: the 'paged' attention function refuses, naming the model, whatever it would otherwise
ignore, and each packed row's position in its own sequence. (Parity of the forward itself is the feature suites'.)"""
import pytest
import torch

from hf_paged.attention import AttentionMetadata
from hf_paged.model.paged_forward import (UnsupportedAttention, check_supported, paged_attention_forward,
                                          sequence_positions)


class Attention(torch.nn.Module):
    config = type("Config", (), {"model_type": "toy"})()


@pytest.mark.parametrize("args, dropout, kwargs, message", [
    ((1,), 0.0, {}, "passes 1 extra positional argument"),
    ((), 0.1, {}, r"attention dropout 0.1 .*model.eval\(\)"),
    ((), 0.0, {"is_causal": False}, "non-causal attention is not supported"),
    ((), 0.0, {"attention_bias": torch.zeros(1)}, r"passes \['attention_bias'\]"),
])
def test_what_the_paged_attention_does_not_implement_is_refused(args, dropout, kwargs, message):
    with pytest.raises(UnsupportedAttention, match="model type 'toy': .*" + message):
        check_supported(Attention(), args, dropout, kwargs)


def test_flags_it_honours_and_empty_values_pass():
    check_supported(Attention(), (), 0.0, {"position_ids": torch.zeros(1), "use_cache": True, "sinks": None,
                                           "output_attentions": False, "is_causal": True})


def test_the_paged_function_outside_the_engine_says_so():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(UnsupportedAttention, match="runs only inside hf_paged's engine.*'toy'"):
        paged_attention_forward(Attention(), q, q, q, None)


def test_sequence_positions_count_from_each_sequences_cached_context():
    # a decode at position 6, a fresh 3-token prompt, a 2-token chunk after 4 cached tokens
    tables = [[1, 2], [3], [4, 5]]
    meta = AttentionMetadata.build([1, 3, 2], [7, 3, 6], tables, list(range(6)), 4, torch.device("cpu"))
    assert sequence_positions(meta).tolist() == [6, 0, 1, 2, 4, 5]
