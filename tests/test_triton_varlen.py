"""attention/backends/triton_varlen.py, the `triton` backend object: its flags, when it is available (triton
installed; a CUDA device, or kernels defined under TRITON_INTERPRET=1), every layout rule it refuses a call for,
and that `forward` hands the call to the launcher unchanged. (tests/test_triton*.py run the kernels.)"""
import os

import torch

if not torch.cuda.is_available():  # before the kernels are defined (see tests/test_triton.py)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'hf_paged[triton]')")

from hf_paged.attention import triton_backend as launcher
from hf_paged.attention.backends import triton_varlen
from hf_paged.attention.backends.triton_varlen import TritonBackend
from hf_paged.attention.extras import EXTRA_NAMES, LayerExtras
from hf_paged.attention.metadata import AttentionMetadata

META = AttentionMetadata.build([1, 3], [5, 3], [[0], [1]], [4, 8, 9, 10], 8, "cpu")


def reason(heads=4, kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, cache_dtype=None):
    query = torch.zeros(4, heads, head_dim, dtype=dtype)
    cache = torch.zeros(3, block_size, kv_heads, head_dim, dtype=cache_dtype or dtype)
    return TritonBackend().layout_reason(query, cache, META, None, None)


def test_flags():
    assert TritonBackend.name == "triton" and TritonBackend.fp8 and TritonBackend.graph_capturable
    assert TritonBackend.prefill and TritonBackend.decode
    assert TritonBackend.extras == frozenset(EXTRA_NAMES) - {"relative"}  # sinks, ALiBi, chunks; no relative bias


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_query_dtypes_with_their_own_or_an_fp8_cache(dtype):
    assert reason(dtype=dtype) is None
    assert reason(dtype=dtype, cache_dtype=torch.float8_e4m3fn) is None


def test_other_dtypes_are_refused():
    assert "float16 / bfloat16 / float32, not torch.float64" in reason(dtype=torch.float64)
    assert "torch.float8_e4m3fn" in reason(dtype=torch.float16, cache_dtype=torch.float32)
    assert "torch.float8_e4m3fn" in reason(dtype=torch.float16, cache_dtype=torch.float8_e5m2)


@pytest.mark.parametrize("block_size, ok", [(4, False), (8, True), (12, False), (16, True), (48, False), (256, True)])
def test_block_size_is_a_power_of_two_from_8(block_size, ok):
    got = reason(block_size=block_size)
    assert (got is None) == ok
    if not ok:
        assert f"not {block_size}" in got


@pytest.mark.parametrize("head_dim, ok", [(8, False), (16, True), (24, True), (36, False), (256, True), (264, False)])
def test_head_dims_16_to_256_in_steps_of_8(head_dim, ok):
    got = reason(head_dim=head_dim)
    assert (got is None) == ok
    if not ok:
        assert "16..256 in steps of 8" in got


@pytest.mark.parametrize("heads, kv_heads, ok", [(6, 4, False), (128, 1, True), (256, 1, False), (256, 2, True)])
def test_gqa_groups_up_to_128_query_heads_per_kv_head(heads, kv_heads, ok):
    got = reason(heads=heads, kv_heads=kv_heads, head_dim=16)
    assert (got is None) == ok
    if not ok:
        assert f"query heads ({heads})" in got and "at most 128" in got


def test_head_dim_must_be_contiguous_and_tensors_on_one_device():
    backend = TritonBackend()
    query = torch.zeros(4, 4, 64)[..., ::2]
    cache = torch.zeros(3, 8, 2, 32)
    assert "contiguous" in backend.layout_reason(query, cache, META, None, None)
    assert "contiguous" in backend.layout_reason(query.contiguous(), torch.zeros(3, 8, 2, 64)[..., ::2], META,
                                                 None, None)
    on_meta = torch.empty(3, 8, 2, 32, device="meta")
    assert "one device" in backend.layout_reason(torch.zeros(4, 4, 32), on_meta, META, None, None)


def test_unavailable_reasons(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(launcher, "IMPORT_ERROR", "triton is not installed (x)")
    assert TritonBackend.unavailable_reason(cuda) == "triton is not installed (x)"  # first, whatever the device
    monkeypatch.setattr(launcher, "IMPORT_ERROR", None)
    monkeypatch.setattr(launcher, "interpreted", lambda: False)
    assert TritonBackend.unavailable_reason(cuda) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "needs a CUDA device" in TritonBackend.unavailable_reason(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "set after the triton kernels were defined" in TritonBackend.unavailable_reason(cpu)
    monkeypatch.setattr(launcher, "interpreted", lambda: True)
    assert TritonBackend.unavailable_reason(cpu) is None
    assert "interpreter mode" in TritonBackend.unavailable_reason(cuda)  # interpreted kernels cannot run on a GPU


def test_forward_hands_everything_to_the_launcher(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_varlen.launcher, "paged_attention",
                        lambda *args, **kwargs: calls.append((args, kwargs)) or "out")
    query, kc, vc = torch.zeros(4, 4, 32), torch.zeros(3, 8, 2, 32), torch.zeros(3, 8, 2, 32)
    extras = LayerExtras(chunk_size=4)
    assert TritonBackend().forward(query, kc, vc, META, 0.3, 7, 5.0, kv_scales=(0.5, 2.0), extras=extras) == "out"
    (args, kwargs), = calls
    assert args[:3] == (query, kc, vc) and args[3] is META and args[4:] == (0.3, 7, 5.0)
    assert kwargs == {"kv_scales": (0.5, 2.0), "extras": extras}
