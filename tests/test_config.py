"""config.py: engine options are validated with the option's name first (a wrong type is an InputTypeError, both a
TypeError and a ValueError), unknown keys are refused, and the default pool and swap sizes."""
import numpy as np
import pytest
import torch

import hf_paged.config as config_module
from hf_paged.config import EngineConfig, InputTypeError, default_kv_cache_bytes, default_swap_bytes, is_integer


def test_is_integer_takes_integer_scalars_only():
    assert all(is_integer(v) for v in (3, np.int32(3), torch.tensor(3)))
    assert not any(is_integer(v) for v in (True, 3.0, np.bool_(True), torch.tensor([3]), torch.tensor(3.0), "3"))


def test_unknown_keys_are_an_error_naming_them():
    with pytest.raises(ValueError, match=r"unknown hf_paged engine option\(s\) \['blok_size'\]"):
        EngineConfig.from_dict({"blok_size": 16})
    assert EngineConfig.from_dict(None) == EngineConfig()


@pytest.mark.parametrize("options, kind, message", [
    ({"block_size": 12}, ValueError, "block_size must be a power of two"),
    ({"block_size": 0}, ValueError, "block_size must be an integer >= 1"),
    ({"num_blocks": 2.0}, InputTypeError, "num_blocks must be an integer"),
    ({"swap_space": -1}, ValueError, "swap_space must be an integer >= 0"),
    ({"enable_prefix_caching": 1}, InputTypeError, "enable_prefix_caching must be True or False"),
    ({"seed": 1 << 64}, ValueError, r"seed must be an integer in \[0, 2\*\*64\)"),
    ({"preemption_mode": "drop"}, ValueError, "preemption_mode must be"),
    ({"kv_scales": 1.0}, ValueError, "kv_scales applies to kv_cache_dtype='fp8_e4m3' only"),
    ({"cuda_graphs": "later"}, ValueError, "cuda_graphs must be"),
    ({"attention_backend": "magic"}, ValueError, "unknown attention_backend 'magic'"),
])
def test_bad_values_are_refused_naming_the_option(options, kind, message):
    with pytest.raises(kind, match="^" + message):
        EngineConfig.from_dict(options)


def test_integer_like_values_become_ints_and_replace_validates():
    config = EngineConfig.from_dict({"num_blocks": torch.tensor(8), "seed": torch.tensor(5)})
    assert type(config.num_blocks) is int and type(config.seed) is int
    with pytest.raises(ValueError, match="block_size"):
        config.replace(block_size=3)
    assert isinstance(InputTypeError("x"), TypeError) and isinstance(InputTypeError("x"), ValueError)


def test_default_sizes_on_cpu(monkeypatch):
    cpu = torch.device("cpu")
    assert default_swap_bytes(cpu) == 0
    monkeypatch.setattr(config_module, "available_host_memory", lambda: 5 << 30)
    assert default_kv_cache_bytes(cpu) == 1 << 30  # 20 % of what is available
    monkeypatch.setattr(config_module, "available_host_memory", lambda: 100 << 30)
    assert default_kv_cache_bytes(cpu) == 2 << 30  # at most 2 GiB
