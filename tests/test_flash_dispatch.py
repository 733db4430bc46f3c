"""The FlashAttention-3 / FlashAttention-2 / FlashInfer backends without the libraries or a GPU.

Stand-in modules in sys.modules record the arguments each backend passes and compute the attention those arguments
describe by the libraries' documented rules (float64): bottom-right causal mask, window (left, right) keeping keys
in [pos - left, pos + right], FlashInfer's window_left, soft-capping cap * tanh(scale * s / cap), pages read
through the page table / CSR page list. A wrong translation (window off by one, wrong context lengths, wrong page
order) therefore shows up as a wrong output, not only as a wrong recorded value. The device checks are forced open.
"""
import sys

import pytest
import torch
from test_attention import MIXED, make_case, reference

from hf_paged.attention import choose_backends, paged_attention, why_not
from hf_paged.attention.backends import fa2, fa3, flashinfer
from hf_paged.attention.metadata import AttentionMetadata
from flash_stand_ins import fake_fa2, fake_fa3, fake_flashinfer

DECODES = [(1, n) for n in (1, 15, 16, 17, 40, 3, 33)]
TOL = dict(atol=2e-3, rtol=2e-3)  # fp16 outputs vs the float64 reference


@pytest.fixture
def installed(monkeypatch):
    """installed(name) puts a recording stand-in for library `name` in sys.modules and opens its device check."""
    def install(name):
        calls = []
        if name == "flash3":
            monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3(calls))
            monkeypatch.setattr(fa3, "cuda_device_reason", lambda *a, **k: None)
        elif name == "flash2":
            monkeypatch.setitem(sys.modules, "flash_attn", fake_fa2(calls))
            monkeypatch.setattr(fa2, "cuda_device_reason", lambda *a, **k: None)
        else:
            monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(calls))
            monkeypatch.setattr(flashinfer, "cuda_device_reason", lambda *a, **k: None)
            monkeypatch.setattr(flashinfer, "WORKSPACE_BYTES", 1024)
        return calls
    return install


def run_case(backend, seqs, block_size, window=None, softcap=None, heads=8, kv_heads=2, head_dim=64, seed=0,
             dtype=torch.float16, transposed=True):
    """Runs `backend` through hf_paged.attention.paged_attention and returns (output, float64 reference, case)."""
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, heads, kv_heads, head_dim, block_size, dtype, seed)
    if transposed:  # as transformers hands it over: [1, H, T, D] transposed to [T, H, D] (not contiguous)
        query = query.transpose(0, 1).contiguous().transpose(0, 1)
        assert not query.is_contiguous()
    out = paged_attention(query, kc, vc, cu, ctx, tables, scale=0.125, sliding_window=window, softcap=softcap,
                          backend=backend)
    ref = reference(query, keys, values, [q for q, _ in seqs], 0.125, window, softcap)
    return out, ref, (query, kc, vc, cu, ctx, tables)


WINDOW_SOFTCAP = [(None, None), (7, None), (None, 5.0), (12, 3.0)]


# ---- FlashAttention-3 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window, softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_fa3_arguments_and_output(installed, seqs, window, softcap):
    calls = installed("flash3")
    out, ref, (query, kc, vc, cu, ctx, tables) = run_case("flash3", seqs, 16, window, softcap)
    torch.testing.assert_close(out.double(), ref, **TOL)
    (call,) = calls
    assert call["q"].shape == query.shape and call["q"].is_contiguous()
    assert call["k_cache"] is kc and call["v_cache"] is vc  # the pages, read in place
    assert call["k"] is None and call["v"] is None  # the new tokens are already stored
    assert torch.equal(call["cache_seqlens"], ctx) and torch.equal(call["cu_seqlens_q"], cu)
    assert torch.equal(call["page_table"], tables)
    assert call["max_seqlen_q"] == max(q for q, _ in seqs)
    assert call["causal"] is True and call["softmax_scale"] == 0.125
    assert call["window_size"] == ((window - 1, 0) if window else (-1, -1))
    assert call["softcap"] == (softcap or 0.0) and isinstance(call["softcap"], float)


def test_fa3_takes_any_page_size_and_mqa(installed):
    installed("flash3")
    for block_size in (1, 8, 128):
        out, ref, _ = run_case("flash3", MIXED, block_size, heads=8, kv_heads=1, seed=block_size)
        torch.testing.assert_close(out.double(), ref, **TOL)


def test_fa3_arguments_are_a_pure_function():
    query, kc, vc, cu, ctx, tables, *_ = make_case(DECODES, 4, 2, 64, 16, torch.bfloat16, seed=1)
    meta = AttentionMetadata.build([1] * len(DECODES), ctx.tolist(), tables.tolist(), [0] * len(DECODES), 16, "cpu")
    args = fa3.fa3_arguments(query, kc, vc, meta, 0.5, 4096, None)
    assert args["window_size"] == (4095, 0) and args["softcap"] == 0.0 and args["max_seqlen_q"] == 1
    assert fa3.fa3_arguments(query, kc, vc, meta, 0.5, None, 2.0)["window_size"] == (-1, -1)


# ---- FlashAttention-2 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window, softcap", WINDOW_SOFTCAP)
def test_fa2_arguments_and_output(installed, window, softcap):
    calls = installed("flash2")
    seqs = [(1, 300), (9, 9), (5, 600), (1, 1), (40, 513)]
    out, ref, (query, kc, vc, cu, ctx, tables) = run_case("flash2", seqs, 256, window, softcap, head_dim=32)
    torch.testing.assert_close(out.double(), ref, **TOL)
    (call,) = calls
    assert call["q"].is_contiguous() and call["k"] is kc and call["v"] is vc
    assert call["cu_seqlens_k"].tolist() == [0, 300, 309, 909, 910, 1423]
    assert torch.equal(call["cu_seqlens_q"], cu) and torch.equal(call["block_table"], tables)
    assert call["max_seqlen_q"] == 40 and call["max_seqlen_k"] == 600
    assert call["causal"] is True and call["dropout_p"] == 0.0
    assert call["window_size"] == ((window - 1, 0) if window else (-1, -1))
    assert call["softcap"] == (softcap or 0.0)


def test_fa2_rejects_pages_that_are_not_multiples_of_256(installed):
    calls = installed("flash2")
    query, kc, vc, cu, ctx, tables, *_ = make_case(MIXED, 8, 2, 64, 16, torch.float16, seed=0)
    meta = AttentionMetadata.build([1], [1], [[0]], [0], 16, "cpu")
    reason = why_not("flash2", query, kc, meta, None, None)
    assert reason is not None and "multiples of 256" in reason and "block_size=16" in reason
    with pytest.raises(ValueError, match="multiples of 256"):
        paged_attention(query, kc, vc, cu, ctx, tables, backend="flash2")
    assert calls == []  # never reached the library
    query, kc, *_ = make_case([(1, 4)], 8, 2, 64, 256, torch.float16, seed=0)
    assert why_not("flash2", query, kc, AttentionMetadata.build([1], [4], [[0]], [3], 256, "cpu"), None, None) is None


def test_fa2_version_and_package_rules(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_fa2([], version="2.5.9"))
    assert "too old" in fa2.FlashAttention2Backend.unavailable_reason(torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    assert "pip install flash-attn" in fa2.FlashAttention2Backend.unavailable_reason(torch.device("cuda"))


# ---- FlashInfer --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window, softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_flashinfer_prefill_wrapper_for_mixed_steps(installed, block_size, window, softcap):
    calls = installed("flashinfer")
    out, ref, (query, kc, vc, cu, ctx, tables) = run_case("flashinfer", MIXED, block_size, window, softcap,
                                                          seed=block_size)
    torch.testing.assert_close(out.double(), ref, **TOL)
    inits = [c for c in calls if c[0] == "init"]
    plans = [c for c in calls if c[0] == "plan"]
    assert [c[1] for c in inits] == ["BatchPrefillWithPagedKVCacheWrapper"] and [c[1] for c in plans] == ["prefill"]
    plan = plans[0][2]
    assert plan["causal"] is True and plan["pos_encoding_mode"] == "NONE" and plan["sm_scale"] == 0.125
    assert plan["window_left"] == (window - 1 if window else -1)
    assert plan["logits_soft_cap"] == (softcap or 0.0)
    assert plan["q_data_type"] == torch.float16 and plan["kv_data_type"] == torch.float16
    assert torch.equal(plan["qo_indptr"], cu)
    pages = [-(-c // block_size) for c in ctx.tolist()]
    assert plan["paged_kv_indptr"].tolist() == [sum(pages[:i]) for i in range(len(pages) + 1)]
    assert plan["paged_kv_indices"].tolist() == [t for row, n in zip(tables.tolist(), pages) for t in row[:n]]
    assert plan["paged_kv_last_page_len"].tolist() == [c - (n - 1) * block_size for c, n in zip(ctx.tolist(), pages)]


@pytest.mark.parametrize("heads, kv_heads, tensor_cores", [(8, 2, False), (16, 2, True), (8, 8, False), (8, 1, True)])
def test_flashinfer_decode_wrapper_for_decode_steps(installed, heads, kv_heads, tensor_cores):
    calls = installed("flashinfer")
    out, ref, _ = run_case("flashinfer", DECODES, 16, 9, None, heads=heads, kv_heads=kv_heads)
    torch.testing.assert_close(out.double(), ref, **TOL)
    (init,) = [c for c in calls if c[0] == "init"]
    assert init[1] == "BatchDecodeWithPagedKVCacheWrapper" and init[2] == {"use_tensor_cores": tensor_cores}
    (plan,) = [c for c in calls if c[0] == "plan"]
    assert plan[1] == "decode" and plan[2]["window_left"] == 8


def test_flashinfer_plans_once_per_step_and_configuration(installed):
    calls = installed("flashinfer")
    query, kc, vc, cu, ctx, tables, keys, values = make_case(MIXED, 8, 2, 64, 16, torch.bfloat16, seed=4)
    qlens = [q for q, _ in MIXED]
    slots = [t[p // 16] * 16 + p % 16 for t, (q, c) in zip(tables.tolist(), MIXED) for p in range(c - q, c)]
    meta = AttentionMetadata.build(qlens, ctx.tolist(), tables.tolist(), slots, 16, "cpu")
    backend = flashinfer.FlashInferBackend()
    for layer in range(4):  # Gemma-2 style: sliding and global layers alternate within one step
        window = 8 if layer % 2 else None
        out = backend.forward(query, kc, vc, meta, 0.125, window, 2.0)
        ref = reference(query, keys, values, qlens, 0.125, window, 2.0)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert sum(c[0] == "plan" for c in calls) == 2 and sum(c[0] == "run" for c in calls) == 4
    assert sum(c[0] == "init" for c in calls) == 2  # one wrapper per configuration, kept across steps
    assert len(backend.wrappers) == 2 and backend.workspace.numel() == 1024  # this object's state, one workspace
    meta2 = AttentionMetadata.build(qlens, ctx.tolist(), tables.tolist(), slots, 16, "cpu")
    backend.forward(query, kc, vc, meta2, 0.125, None, 2.0)  # next step: planned again
    assert sum(c[0] == "plan" for c in calls) == 3 and sum(c[0] == "init" for c in calls) == 2
    flashinfer.FlashInferBackend().forward(query, kc, vc, meta2, 0.125, None, 2.0)  # another object: its own wrapper
    assert sum(c[0] == "init" for c in calls) == 3


@pytest.mark.parametrize("name, module, tables", [("flash3", fa3, "fa3_tables"), ("flash2", fa2, "fa2_tables")])
def test_int32_tables_are_built_once_per_step_by_the_chooser_s_backend(installed, monkeypatch, name, module, tables):
    """Through one chooser (as the engine runs it), every layer of a step reuses the tables the first layer built,
    kept in the backend object; a new step's metadata builds them again."""
    installed(name)
    built = []
    original = getattr(module, tables)
    monkeypatch.setattr(module, tables, lambda meta: built.append(meta) or original(meta))
    block = 256 if name == "flash2" else 16
    seqs = [(1, 300), (9, 9), (5, 40)]
    query, kc, vc, cu, ctx, tables_, *_ = make_case(seqs, 8, 2, 64, block, torch.float16, seed=2)
    backends = choose_backends(name, "cpu")
    steps = [AttentionMetadata.build([q for q, _ in seqs], ctx.tolist(), tables_.tolist(), [0] * 15, block, "cpu")
             for _ in range(2)]
    for meta in steps:
        for _ in range(3):  # layers
            backends.attend(query, kc, vc, meta, 0.125)
    assert built == steps  # once per step, not per layer
    assert backends.backend_for(query, kc, steps[0], None, None).tables.metadata is steps[1]


# ---- shared rules ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["flash3", "flash2", "flashinfer"])
def test_float32_and_odd_head_dims_are_unsupported(installed, name):
    installed(name)
    block = 256 if name == "flash2" else 16
    query, kc, *_ = make_case([(1, 4)], 8, 2, 64, block, torch.float32, seed=0)
    meta = AttentionMetadata.build([1], [4], [[0]], [3], block, "cpu")
    assert "float16 / bfloat16" in why_not(name, query, kc, meta, None, None)
    query, kc, *_ = make_case([(1, 4)], 8, 2, 36, block, torch.float16, seed=0)
    assert "head_dim" in why_not(name, query, kc, meta, None, None)
    query, kc, *_ = make_case([(1, 4)], 8, 2, 64, block, torch.float16, seed=0)
    assert why_not(name, query, kc, meta, None, None) is None
    assert "KV cache" in why_not(name, query, kc.to(torch.bfloat16), meta, None, None)
    assert "does not read scaled fp8 caches" in why_not(name, query, kc.to(torch.float8_e4m3fn), meta, None, None)


@pytest.mark.parametrize("name, module, package", [("flash3", fa3.FlashAttention3Backend, "flash_attn_interface"),
                                                   ("flash2", fa2.FlashAttention2Backend, "flash_attn"),
                                                   ("flashinfer", flashinfer.FlashInferBackend, "flashinfer")])
def test_unavailable_reasons(monkeypatch, name, module, package):
    for other in fa3.PACKAGES:
        monkeypatch.setitem(sys.modules, other, None)
    monkeypatch.setitem(sys.modules, package, None)
    assert "not installed" in module.unavailable_reason(torch.device("cuda"))
    fake = {"flash3": fake_fa3, "flash2": fake_fa2, "flashinfer": fake_flashinfer}[name]([])
    monkeypatch.setitem(sys.modules, package, fake)
    assert "CUDA" in module.unavailable_reason(torch.device("cpu"))
    if torch.cuda.is_available():
        return
    assert "CUDA" in module.unavailable_reason(torch.device("cuda"))  # no device here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ampere = module.unavailable_reason(torch.device("cuda"))
    assert (ampere is not None and "8.0" in ampere) if name == "flash3" else ampere is None  # FA3 is Hopper-only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert module.unavailable_reason(torch.device("cuda")) is None
