"""The census's PagedCache column (hf_paged/bench/models_census.py): HF's generate on a passed hf_paged.PagedCache, a few types."""
import pytest

from hf_paged.bench import models_census as census


@pytest.mark.parametrize("model_type, outcome, reason", [
    ("llama", "exact", ""),
    ("gemma2", "exact", ""),  # sliding-window layers keep every position; the mask applies the window
    ("jetmoe", "exact", ""),  # its attention reshapes the K/V the cache returns: the in-place probe keeps the copy
    ("falcon_mamba", "exact", ""),  # state layers: transformers' own LinearAttentionLayer inside the PagedCache
    ("xlnet", "HF rejects", "does not use a passed cache"),  # its own memory: a passed DynamicCache stays empty too
])
def test_paged_cache_column(model_type, outcome, reason, one_torch_thread):
    result = census.run_one(model_type)["paged_cache"]
    assert result["outcome"] == outcome, result
    assert reason in result.get("reason", ""), result


def test_table_has_both_columns_and_totals():
    table = census.markdown({"a": {"outcome": "exact", "paged_cache": {"outcome": "exact"}},
                             "b": {"outcome": "refused", "reason": "r1", "paged_cache": {"outcome": "refused",
                                                                                          "reason": "r2"}}})
    assert "| model type | outcome | reason | PagedCache |" in table
    assert "Totals: paged engine: exact 1, refused 1; PagedCache: exact 1, refused 1" in table
    assert "| b | refused | r1 | refused: r2 |" in table
