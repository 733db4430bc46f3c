"""model/relative_attention.py: which modules take the paged relative-bias forward, and the log scaling of a
full-attention layer's logits by each query's position (its engine parity is test_relative_logits.py's)."""
import math
from types import SimpleNamespace

import torch

from hf_paged.model.relative_attention import RELATIVE_ATTENTION, log_scale, relative_attention_modules
from hf_paged.tiny import tiny_hybrid, tiny_model


def test_log_scale_is_one_up_to_the_floor_then_grows_with_log_position():
    config = SimpleNamespace(log_scaling_n_floor=4, log_scaling_alpha=0.5)
    got = log_scale(config, torch.tensor([0, 3, 7, 15]))
    want = [1.0, 1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(4)]
    assert torch.allclose(got, torch.tensor(want))


def test_every_inkling_attention_module_and_nothing_else_is_found():
    model = tiny_hybrid("inkling_text")
    found = relative_attention_modules(model)
    assert found and all(factory is RELATIVE_ATTENTION[type(m).__name__] for m, factory in found)
    assert [m for m, _ in found] == [m for m in model.modules() if type(m).__name__ == "InklingAttention"]
    assert relative_attention_modules(tiny_model("llama")) == []
