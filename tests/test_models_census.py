"""A fast subset of the model census (hf_paged/bench/models_census.py): the same code path, a few telling model types."""
import pytest

from hf_paged.bench import models_census as census


@pytest.mark.parametrize("model_type, outcome, reason", [
    ("llama", "exact", ""),
    ("granite", "exact", ""),
    ("gpt_oss", "exact", ""),  # attention sinks join the softmax
    ("flint", "exact", ""),
    ("jetmoe", "exact", ""),  # K/V shapes read from what the modules produce, not config fields
    ("mimo_v2_flash", "exact", ""),  # layers with K/V of different shapes, V heads smaller than K heads
    ("diffllama", "exact", ""),  # differential attention: two calls per layer, K/V stored by call
    ("llama4", "exact", ""),  # chunked attention layers
    ("bloom", "exact", ""),  # ALiBi, computed inside its attention modules
    ("mpt", "exact", ""),
    ("roberta", "exact", ""),  # the start-up check calls the model's own forward with position ids, as generate does
    ("bart", "exact", ""),
    ("xglm", "exact", ""),  # its attention modules compute attention themselves: a paged forward replaces theirs  # its decoder computes positions as arange(T): each packed row gets its own instead
    ("whisper", "exact", ""),  # HF's padded batch counts the padding in its positions: such a batch runs HF's loop
])
def test_census_outcomes(model_type, outcome, reason, one_torch_thread):
    result = census.run_one(model_type)
    assert result["outcome"] == outcome, result
    assert reason in result.get("reason", ""), result


def test_every_registered_type_is_listed():
    types = census.model_types()
    assert len(types) > 100 and "llama" in types and "gpt_oss" in types
