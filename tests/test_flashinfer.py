"""attention/backends/flashinfer.py, the `flashinfer` backend, on its own: the CSR page list built from the metadata,
the plan / run arguments of each wrapper, its head-size rule, and the wrappers it keeps (one per configuration,
planned once per step). (tests/test_flash_dispatch.py runs it end to end through a float64 stand-in.)"""
import sys
import types

import pytest
import torch

from hf_paged.attention.backends import flashinfer
from hf_paged.attention.extras import LayerExtras
from hf_paged.attention.metadata import AttentionMetadata


def metadata(query_lens, context_lens, tables, block_size=8):
    return AttentionMetadata.build(query_lens, context_lens, tables, [0] * sum(query_lens), block_size, "cpu")


def tensors(tokens, heads=8, kv_heads=2, head_dim=64, dtype=torch.float16, block_size=8):
    query = torch.randn(heads, tokens, head_dim).to(dtype).transpose(0, 1)
    cache = torch.zeros(12, block_size, kv_heads, head_dim, dtype=dtype)
    return query, cache, cache.clone()


# context 8 = exactly one full page; 9 = a full page and one token; 1 = one token; 24 = three full pages
MIXED = ([1, 5, 1, 3], [8, 9, 1, 24], [[3, 9], [0, 11], [7], [1, 2, 4, 6]])


def test_page_list_is_the_csr_of_the_used_pages():
    pages = flashinfer.page_list(metadata(*MIXED))
    assert pages["qo_indptr"].tolist() == [0, 1, 6, 7, 10]
    assert pages["paged_kv_indptr"].tolist() == [0, 1, 3, 4, 7]  # 1, 2, 1, 3 pages used
    assert pages["paged_kv_indices"].tolist() == [3, 0, 11, 7, 1, 2, 4]  # unused table entries (9, 6) left out
    assert pages["paged_kv_last_page_len"].tolist() == [8, 1, 1, 8]  # a full last page is page_size, never 0
    for t in pages.values():
        assert t.dtype == torch.int32 and t.is_contiguous()
    # the indptrs and last-page lengths are read by plan on the host
    assert all(pages[k].device.type == "cpu" for k in ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len"))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_page_list_at_other_page_sizes(block_size):
    lens = [1, 4, 5, 17]
    tables = [list(range(10 * i, 10 * i + -(-c // block_size))) for i, c in enumerate(lens)]
    pages = flashinfer.page_list(metadata([1] * 4, lens, tables, block_size))
    counts = [-(-c // block_size) for c in lens]
    assert pages["paged_kv_indptr"].tolist() == [sum(counts[:i]) for i in range(5)]
    assert pages["paged_kv_indices"].tolist() == [p for t in tables for p in t]
    last = pages["paged_kv_last_page_len"].tolist()
    assert [(n - 1) * block_size + l for n, l in zip(counts, last)] == lens
    assert all(1 <= l <= block_size for l in last)


def test_prefill_arguments():
    meta = metadata(*MIXED)
    query, kc, vc = tensors(10)
    args = flashinfer.flashinfer_arguments(query, kc, vc, meta, 0.125, 16, 30.0)
    assert args["decode"] is False and args["use_tensor_cores"] is False
    (qo, indptr, indices, last, heads, kv_heads, head_dim, page), kwargs = args["plan"]
    assert qo.tolist() == [0, 1, 6, 7, 10] and indptr.tolist() == [0, 1, 3, 4, 7]
    assert (heads, kv_heads, head_dim, page) == (8, 2, 64, 8)
    assert kwargs == dict(causal=True, pos_encoding_mode="NONE", window_left=15, logits_soft_cap=30.0,
                          q_data_type=torch.float16, kv_data_type=torch.float16, sm_scale=0.125)
    (q, (k, v)), run_kwargs = args["run"]
    assert q.is_contiguous() and torch.equal(q, query) and k is kc and v is vc and run_kwargs == {}


def test_decode_arguments_have_no_query_indptr_nor_causal():
    meta = metadata([1, 1], [9, 3], [[2, 5], [1]])
    query, kc, vc = tensors(2, heads=16, kv_heads=2)
    args = flashinfer.flashinfer_arguments(query, kc, vc, meta, 0.5, None, None)
    assert args["decode"] is True
    plan_args, kwargs = args["plan"]
    assert len(plan_args) == 7 and plan_args[0].tolist() == [0, 2, 3] and plan_args[3:] == (16, 2, 64, 8)
    assert "causal" not in kwargs and kwargs["window_left"] == -1 and kwargs["logits_soft_cap"] == 0.0


@pytest.mark.parametrize("heads, kv_heads, tensor_cores", [(4, 4, False), (8, 2, False), (10, 2, True), (8, 1, True)])
def test_tensor_cores_above_four_queries_per_kv_head(heads, kv_heads, tensor_cores):
    query, kc, vc = tensors(2, heads=heads, kv_heads=kv_heads)
    args = flashinfer.flashinfer_arguments(query, kc, vc, metadata([1, 1], [9, 3], [[2, 5], [1]]), 0.5, None, None)
    assert args["use_tensor_cores"] is tensor_cores


def test_given_pages_are_used_as_they_are():
    meta = metadata(*MIXED)
    query, kc, vc = tensors(10)
    pages = {k: v.clone() for k, v in flashinfer.page_list(meta).items()}
    args = flashinfer.flashinfer_arguments(query, kc, vc, meta, 0.5, None, None, pages)
    assert args["plan"][0][0] is pages["qo_indptr"] and args["plan"][0][2] is pages["paged_kv_indices"]


@pytest.mark.parametrize("head_dim, supported", [(64, True), (128, True), (256, True), (96, False), (32, False)])
def test_head_dims(head_dim, supported):
    query, kc, _ = tensors(10, head_dim=head_dim)
    reason = flashinfer.FlashInferBackend().layout_reason(query, kc, metadata(*MIXED), None, None)
    assert (reason is None) == supported
    if not supported:
        assert "head_dim in (64, 128, 256)" in reason


def recording_library(log):
    module = types.ModuleType("flashinfer")

    class Wrapper:
        def __init__(self, workspace, layout, **options):
            log.append(("init", type(self).__name__, layout, options, workspace))

        def plan(self, *args, **kwargs):
            log.append(("plan", type(self).__name__, args, kwargs))

        def run(self, q, caches):
            log.append(("run", type(self).__name__))
            return q * 2

    module.BatchDecodeWithPagedKVCacheWrapper = type("BatchDecodeWithPagedKVCacheWrapper", (Wrapper,), {})
    module.BatchPrefillWithPagedKVCacheWrapper = type("BatchPrefillWithPagedKVCacheWrapper", (Wrapper,), {})
    return module


def test_wrappers_per_configuration_planned_once_per_step(monkeypatch):
    log = []
    monkeypatch.setitem(sys.modules, "flashinfer", recording_library(log))
    monkeypatch.setattr(flashinfer, "WORKSPACE_BYTES", 64)
    backend = flashinfer.FlashInferBackend()
    prefill, decode = metadata(*MIXED), metadata([1, 1], [9, 3], [[2, 5], [1]])
    query, kc, vc = tensors(10)
    for window in (None, 8, None, 8):  # alternating layers of one step
        out = backend.forward(query, kc, vc, prefill, 0.125, window, None)
        assert torch.equal(out, query * 2)
    assert [e[:2] for e in log if e[0] != "run"] == [
        ("init", "BatchPrefillWithPagedKVCacheWrapper"), ("plan", "BatchPrefillWithPagedKVCacheWrapper"),
        ("init", "BatchPrefillWithPagedKVCacheWrapper"), ("plan", "BatchPrefillWithPagedKVCacheWrapper")]
    assert sum(e[0] == "run" for e in log) == 4
    inits = [e for e in log if e[0] == "init"]
    assert all(e[2] == "NHD" and e[4] is backend.workspace for e in inits) and backend.workspace.numel() == 64
    log.clear()
    backend.forward(query[:2], kc, vc, decode, 0.125, None, None)  # the next step: a decode-only one
    assert [e[:2] for e in log] == [("init", "BatchDecodeWithPagedKVCacheWrapper"),
                                    ("plan", "BatchDecodeWithPagedKVCacheWrapper"),
                                    ("run", "BatchDecodeWithPagedKVCacheWrapper")]
    assert log[0][3] == {"use_tensor_cores": False}
    log.clear()
    backend.forward(query, kc, vc, metadata(*MIXED), 0.125, None, None)  # a new step reuses the wrapper, replans
    assert [e[:2] for e in log] == [("plan", "BatchPrefillWithPagedKVCacheWrapper"),
                                    ("run", "BatchPrefillWithPagedKVCacheWrapper")]
    assert len(backend.wrappers) == 3


def test_forward_without_the_library_raises_its_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    query, kc, vc = tensors(10)
    with pytest.raises(RuntimeError, match="pip install flashinfer-python"):
        flashinfer.FlashInferBackend().forward(query, kc, vc, metadata(*MIXED), 0.5, None, None)
    assert "not installed" in flashinfer.FlashInferBackend.unavailable_reason(torch.device("cuda"))


def test_forward_refuses_layer_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", recording_library([]))
    query, kc, vc = tensors(10)
    with pytest.raises(ValueError, match="flashinfer attention backend does not implement"):
        flashinfer.FlashInferBackend().forward(query, kc, vc, metadata(*MIXED), 0.5, None, None,
                                               extras=LayerExtras(chunk_size=4))
