"""attention/backends/fa2.py, the `flash2` backend, on its own: version parsing, which flash_attn it accepts, the
int32 tables and keyword arguments it builds for flash_attn_varlen_func, its page-size rule and how `forward` calls
the library. (tests/test_flash_dispatch.py runs it end to end through a float64 stand-in of the library.)"""
import sys
import types

import pytest
import torch

from hf_paged.attention.backends import fa2
from hf_paged.attention.extras import LayerExtras
from hf_paged.attention.metadata import AttentionMetadata

# three sequences: a decode over 300 keys, a 9-token prompt, a 5-token chunk over 600 keys
QUERY_LENS, CONTEXT_LENS = [1, 9, 5], [300, 9, 600]
TABLES = [[4, 7], [1], [0, 2, 3]]


def metadata(block_size=256):
    slots = [0] * sum(QUERY_LENS)
    return AttentionMetadata.build(QUERY_LENS, CONTEXT_LENS, TABLES, slots, block_size, "cpu")


def tensors(block_size=256, heads=8, kv_heads=2, head_dim=64, dtype=torch.float16):
    query = torch.randn(heads, sum(QUERY_LENS), head_dim).to(dtype).transpose(0, 1)  # not contiguous, as HF's
    cache = torch.zeros(8, block_size, kv_heads, head_dim, dtype=dtype)
    return query, cache, cache.clone()


def flash_attn(version="2.7.4", varlen=True):
    module = types.ModuleType("flash_attn")
    module.__version__ = version
    if varlen:
        module.flash_attn_varlen_func = lambda **kwargs: None
    return module


@pytest.mark.parametrize("version, parsed", [("2.7.4", (2, 7)), ("2.6.3.post1", (2, 6)), ("2.10.0", (2, 10)),
                                             ("3.0.0b1", (3, 0)), ("dev", (0,)),
                                             ("2.6+cu121", (2, 6)), ("2.5rc1", (2, 5))])
def test_version_reads_major_and_minor_as_numbers(version, parsed):
    assert fa2._version(types.SimpleNamespace(__version__=version)) == parsed
    assert fa2._version(types.SimpleNamespace()) == (0,)  # no __version__ at all


@pytest.mark.parametrize("version, accepted", [("2.5.9", False), ("2.6.0", True), ("2.10.1", True), ("1.0.9", False)])
def test_library_needs_2_6_for_soft_capping(monkeypatch, version, accepted):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn(version))
    module, reason = fa2._library()
    if accepted:
        assert module is sys.modules["flash_attn"] and reason is None
    else:
        assert module is None and "too old" in reason and ">= 2.6" in reason and version in reason


def test_library_without_varlen_func_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn(varlen=False))
    module, reason = fa2._library()
    assert module is None and "no flash_attn_varlen_func" in reason


def test_tables_are_int32_and_cu_seqlens_k_sums_the_context_lengths():
    meta = metadata()
    block_table, cu_q, cu_k = fa2.fa2_tables(meta)
    for t in (block_table, cu_q, cu_k):
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert cu_k.tolist() == [0, 300, 309, 909]
    assert cu_q.tolist() == [0, 1, 10, 15]
    assert block_table.tolist() == [[4, 7, 0], [1, 0, 0], [0, 2, 3]]


@pytest.mark.parametrize("window, softcap, expected_window, expected_cap", [
    (None, None, (-1, -1), 0.0), (128, None, (127, 0), 0.0), (None, 30, (-1, -1), 30.0), (1, 50.0, (0, 0), 50.0)])
def test_arguments(window, softcap, expected_window, expected_cap):
    query, kc, vc = tensors()
    meta = metadata()
    args = fa2.fa2_arguments(query, kc, vc, meta, 0.125, window, softcap)
    assert args["q"].is_contiguous() and torch.equal(args["q"], query)
    assert args["k"] is kc and args["v"] is vc  # the page pools, in place
    assert args["max_seqlen_q"] == 9 and args["max_seqlen_k"] == 600
    assert args["softmax_scale"] == 0.125 and args["causal"] is True
    assert args["window_size"] == expected_window
    assert args["softcap"] == expected_cap and isinstance(args["softcap"], float)
    assert args["cu_seqlens_k"].tolist() == [0, 300, 309, 909]
    assert set(args) == {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                         "softmax_scale", "causal", "window_size", "softcap", "block_table"}


def test_arguments_use_the_tables_they_are_given():
    query, kc, vc = tensors()
    tables = (torch.zeros(3, 3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
              torch.zeros(4, dtype=torch.int32))
    args = fa2.fa2_arguments(query, kc, vc, metadata(), 1.0, None, None, tables)
    assert args["block_table"] is tables[0] and args["cu_seqlens_q"] is tables[1] and args["cu_seqlens_k"] is tables[2]


@pytest.mark.parametrize("block_size, supported", [(16, False), (128, False), (256, True), (512, True), (768, True)])
def test_pages_must_be_a_multiple_of_256_tokens(block_size, supported):
    query, kc, _ = tensors(block_size=block_size)
    reason = fa2.FlashAttention2Backend().layout_reason(query, kc, metadata(block_size), None, None)
    if supported:
        assert reason is None
    else:
        assert f"block_size={block_size}" in reason and "multiples of 256" in reason


def test_layout_reason_then_applies_the_shared_rules():
    query, kc, _ = tensors(dtype=torch.float32)
    assert "float16 / bfloat16" in fa2.FlashAttention2Backend().layout_reason(query, kc, metadata(), None, None)


def test_forward_passes_the_arguments_and_unwraps_a_tuple(monkeypatch):
    calls = []
    module = flash_attn()
    out = torch.ones(15, 8, 64)
    module.flash_attn_varlen_func = lambda **kwargs: calls.append(kwargs) or (out, "lse")
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    backend = fa2.FlashAttention2Backend()
    query, kc, vc = tensors()
    meta = metadata()
    assert backend.forward(query, kc, vc, meta, 0.5, 64, None) is out
    (call,) = calls
    expected = fa2.fa2_arguments(query, kc, vc, meta, 0.5, 64, None)
    assert call.keys() == expected.keys() and call["window_size"] == (63, 0) and call["softmax_scale"] == 0.5
    module.flash_attn_varlen_func = lambda **kwargs: out  # a library that returns the tensor alone
    assert backend.forward(query, kc, vc, meta, 0.5, None, None) is out


def test_forward_without_the_library_raises_its_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    backend = fa2.FlashAttention2Backend()
    query, kc, vc = tensors()
    with pytest.raises(RuntimeError, match="pip install flash-attn"):
        backend.forward(query, kc, vc, metadata(), 0.5, None, None)


def test_forward_refuses_layer_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn())
    query, kc, vc = tensors()
    extras = LayerExtras(sinks=torch.zeros(8))
    with pytest.raises(ValueError, match="flash2 attention backend does not implement"):
        fa2.FlashAttention2Backend().forward(query, kc, vc, metadata(), 0.5, None, None, extras=extras)


def test_available_only_with_the_library_and_an_ampere_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn())
    assert "CUDA" in fa2.FlashAttention2Backend.unavailable_reason(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "7.5" in fa2.FlashAttention2Backend.unavailable_reason(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    assert fa2.FlashAttention2Backend.unavailable_reason(torch.device("cuda")) is None  # no upper bound
