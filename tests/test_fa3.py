"""attention/backends/fa3.py, the `flash3` backend, on its own: which package provides FlashAttention-3, the int32
tables and keyword arguments it builds for flash_attn_with_kvcache, its Hopper-only device rule and how `forward`
calls the library. (tests/test_flash_dispatch.py runs it end to end through a float64 stand-in of the library.)"""
import sys
import types

import pytest
import torch

from hf_paged.attention.backends import fa3
from hf_paged.attention.extras import LayerExtras
from hf_paged.attention.metadata import AttentionMetadata

QUERY_LENS, CONTEXT_LENS = [1, 7, 3, 1], [33, 7, 20, 1]
TABLES = [[5, 1, 9], [2], [0, 4], [3]]


def metadata(block_size=16):
    return AttentionMetadata.build(QUERY_LENS, CONTEXT_LENS, TABLES, [0] * sum(QUERY_LENS), block_size, "cpu")


def tensors(heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16):
    query = torch.randn(heads, sum(QUERY_LENS), head_dim).to(dtype).transpose(0, 1)
    cache = torch.zeros(10, block_size, kv_heads, head_dim, dtype=dtype)
    return query, cache, cache.clone()


def package(name, with_kvcache=True):
    module = types.ModuleType(name)
    if with_kvcache:
        module.flash_attn_with_kvcache = lambda **kwargs: None
    return module


@pytest.fixture
def no_fa3(monkeypatch):
    for name in fa3.PACKAGES:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "flash_attn_3", None)


def test_first_package_with_flash_attn_with_kvcache_wins(monkeypatch, no_fa3):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", package("flash_attn_interface", with_kvcache=False))
    later = package("flash_attn_3")
    monkeypatch.setitem(sys.modules, "flash_attn_3", later)
    module, reason = fa3._library()
    assert module is later and reason is None  # a module of that name without the function is passed over
    first = package("flash_attn_interface")
    monkeypatch.setitem(sys.modules, "flash_attn_interface", first)
    assert fa3._library() == (first, None)


def test_no_package_names_every_one_tried(no_fa3):
    module, reason = fa3._library()
    assert module is None and "not installed" in reason
    assert all(name in reason for name in fa3.PACKAGES) and "hopper/" in reason


def test_tables_are_int32_copies_of_the_metadata():
    meta = metadata()
    page_table, cache_seqlens, cu_q = fa3.fa3_tables(meta)
    for t in (page_table, cache_seqlens, cu_q):
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert cache_seqlens.tolist() == CONTEXT_LENS  # this step's tokens included: bottom-right causal alignment
    assert cu_q.tolist() == [0, 1, 8, 11, 12]
    assert page_table.tolist() == [[5, 1, 9], [2, 0, 0], [0, 4, 0], [3, 0, 0]]


@pytest.mark.parametrize("window, softcap, expected_window, expected_cap", [
    (None, None, (-1, -1), 0.0), (4096, None, (4095, 0), 0.0), (None, 30, (-1, -1), 30.0), (2, 50.0, (1, 0), 50.0)])
def test_arguments(window, softcap, expected_window, expected_cap):
    query, kc, vc = tensors()
    args = fa3.fa3_arguments(query, kc, vc, metadata(), 0.25, window, softcap)
    assert args["q"].is_contiguous() and torch.equal(args["q"], query)
    assert args["k_cache"] is kc and args["v_cache"] is vc
    assert "k" not in args and "v" not in args  # the new K/V are already in the pages
    assert args["max_seqlen_q"] == 7 and args["softmax_scale"] == 0.25 and args["causal"] is True
    assert args["window_size"] == expected_window
    assert args["softcap"] == expected_cap and isinstance(args["softcap"], float)
    assert args["cache_seqlens"].tolist() == CONTEXT_LENS


def test_arguments_use_the_tables_they_are_given():
    query, kc, vc = tensors()
    tables = tuple(torch.zeros(4, dtype=torch.int32) for _ in range(3))
    args = fa3.fa3_arguments(query, kc, vc, metadata(), 1.0, None, None, tables)
    assert args["page_table"] is tables[0] and args["cache_seqlens"] is tables[1] and args["cu_seqlens_q"] is tables[2]


@pytest.mark.parametrize("block_size", [1, 16, 64, 96])
def test_any_page_size_is_supported(block_size):
    query, kc, _ = tensors(block_size=block_size)
    assert fa3.FlashAttention3Backend().layout_reason(query, kc, metadata(block_size), None, None) is None


def test_layout_reason_applies_the_shared_rules():
    query, kc, _ = tensors(heads=6, kv_heads=4)
    assert "multiple of KV heads" in fa3.FlashAttention3Backend().layout_reason(query, kc, metadata(), None, None)


@pytest.mark.parametrize("capability, ok", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), False)])
def test_hopper_only(monkeypatch, capability, ok):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", package("flash_attn_interface"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reason = fa3.FlashAttention3Backend.unavailable_reason(torch.device("cuda"))
    assert (reason is None) == ok
    if not ok:
        assert f"{capability[0]}.{capability[1]}" in reason


def test_missing_library_comes_before_the_device_check(monkeypatch, no_fa3):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "not installed" in fa3.FlashAttention3Backend.unavailable_reason(torch.device("cuda"))


def test_forward_passes_the_arguments_and_unwraps_a_tuple(monkeypatch):
    calls, out = [], torch.ones(12, 8, 64)
    module = package("flash_attn_interface")
    module.flash_attn_with_kvcache = lambda **kwargs: calls.append(kwargs) or (out, "lse")
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    backend = fa3.FlashAttention3Backend()
    query, kc, vc = tensors()
    meta = metadata()
    assert backend.forward(query, kc, vc, meta, 0.5, None, 20.0) is out
    (call,) = calls
    assert call.keys() == fa3.fa3_arguments(query, kc, vc, meta, 0.5, None, 20.0).keys()
    assert call["softcap"] == 20.0 and call["page_table"].tolist()[0] == [5, 1, 9]
    module.flash_attn_with_kvcache = lambda **kwargs: out
    assert backend.forward(query, kc, vc, meta, 0.5, None, None) is out


def test_forward_without_the_library_raises_its_reason(no_fa3):
    query, kc, vc = tensors()
    with pytest.raises(RuntimeError, match="FlashAttention-3 is not installed"):
        fa3.FlashAttention3Backend().forward(query, kc, vc, metadata(), 0.5, None, None)


def test_forward_refuses_layer_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", package("flash_attn_interface"))
    query, kc, vc = tensors()
    with pytest.raises(ValueError, match="flash3 attention backend does not implement"):
        fa3.FlashAttention3Backend().forward(query, kc, vc, metadata(), 0.5, None, None,
                                             extras=LayerExtras(alibi_slopes=torch.zeros(8)))
