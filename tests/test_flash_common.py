"""attention/backends/flash_common.py: the rules the flash libraries' backends share (imports, device checks,
dtype / head-size rules, the window translation, int32 tables), each checked on its own without a GPU."""
import sys
import types

import pytest
import torch

from hf_paged.attention.backends import flash_common as fc


def q_and_cache(heads=8, kv_heads=2, head_dim=64, dtype=torch.float16, block_size=16):
    return torch.zeros(5, heads, head_dim, dtype=dtype), torch.zeros(4, block_size, kv_heads, head_dim, dtype=dtype)


# ---- import_first -------------------------------------------------------------------------------------------
def test_import_first_takes_the_first_name_that_imports(monkeypatch):
    first, second = types.ModuleType("lib_a"), types.ModuleType("lib_b")
    monkeypatch.setitem(sys.modules, "lib_a", None)  # "not installed"
    monkeypatch.setitem(sys.modules, "lib_b", second)
    monkeypatch.setitem(sys.modules, "lib_c", first)
    module, error = fc.import_first("lib_a", "lib_b", "lib_c")
    assert module is second and error is None


def test_import_first_reports_the_last_error_and_survives_broken_builds(monkeypatch, tmp_path):
    (tmp_path / "hfp_broken_build.py").write_text("raise OSError('undefined symbol: flash_fwd')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "hfp_missing_lib", None)
    module, error = fc.import_first("hfp_missing_lib", "hfp_broken_build")
    assert module is None
    assert error.startswith("hfp_broken_build: OSError:") and "undefined symbol" in error  # the last one's error
    module, error = fc.import_first("hfp_broken_build", "hfp_missing_lib")
    assert module is None and error.startswith("hfp_missing_lib: ")


# ---- cuda_device_reason -------------------------------------------------------------------------------------
def test_cpu_tensors_are_refused_before_anything_asks_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked CUDA for a CPU device"))
    assert "CUDA devices only" in fc.cuda_device_reason(torch.device("cpu"), "Lib")
    assert "(tensors are on cpu)" in fc.cuda_device_reason("cpu", "Lib")  # a string device is taken too


def test_no_cuda_device_is_a_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fc.cuda_device_reason(torch.device("cuda"), "Lib") == "Lib needs CUDA, and torch sees no CUDA device"


@pytest.mark.parametrize("capability, minimum, max_major, ok", [
    ((8, 0), (8, 0), None, True), ((7, 5), (8, 0), None, False), ((8, 9), (9, 0), None, False),
    ((9, 0), (9, 0), 9, True), ((10, 0), (9, 0), 9, False), ((12, 0), (8, 0), None, True), ((8, 6), (8, 0), 9, True)])
def test_compute_capability_bounds(monkeypatch, capability, minimum, max_major, ok):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reason = fc.cuda_device_reason(torch.device("cuda"), "Lib", min_capability=minimum, max_major=max_major)
    if ok:
        assert reason is None
    else:
        assert f"compute capability {capability[0]}.{capability[1]}" in reason
        assert f">= {minimum[0]}.{minimum[1]}" in reason
        assert ("major <= 9" in reason) == (max_major is not None)


# ---- common_unsupported_reason ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_queries_with_a_cache_of_their_dtype_are_supported(dtype):
    assert fc.common_unsupported_reason("Lib", *q_and_cache(dtype=dtype)) is None


def test_each_rule_gives_its_reason():
    q, kc = q_and_cache()
    assert "float16 / bfloat16" in fc.common_unsupported_reason("Lib", q.float(), kc.float())
    assert "query dtype" in fc.common_unsupported_reason("Lib", q, kc.bfloat16())
    assert "multiple of 8" in fc.common_unsupported_reason("Lib", *q_and_cache(head_dim=60))
    assert "<= 256" in fc.common_unsupported_reason("Lib", *q_and_cache(head_dim=264))
    assert fc.common_unsupported_reason("Lib", *q_and_cache(head_dim=256)) is None
    assert "<= 128" in fc.common_unsupported_reason("Lib", *q_and_cache(head_dim=192), max_head_dim=128)
    assert "head_dim in (64, 128)" in fc.common_unsupported_reason("Lib", *q_and_cache(head_dim=96),
                                                                   head_dims=(64, 128))
    assert fc.common_unsupported_reason("Lib", *q_and_cache(head_dim=128), head_dims=(64, 128)) is None
    assert "multiple of KV heads (3)" in fc.common_unsupported_reason("Lib", *q_and_cache(heads=8, kv_heads=3))
    assert fc.common_unsupported_reason("Lib", *q_and_cache(heads=8, kv_heads=1)) is None  # MQA
    strided = torch.zeros(4, 16, 2, 128, dtype=torch.float16)[..., ::2]
    assert "head_dim contiguous" in fc.common_unsupported_reason("Lib", q, strided)


def test_the_library_name_is_in_the_reason():
    q, kc = q_and_cache()
    assert fc.common_unsupported_reason("SomeLib", q.float(), kc.float()).startswith("SomeLib ")


# ---- window_left / as_int32 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("window, left", [(None, -1), (0, -1), (1, 0), (4096, 4095)])
def test_window_left_is_the_number_of_earlier_keys(window, left):
    assert fc.window_left(window) == left


def test_window_left_keeps_exactly_the_window_keys():
    """hf_paged's window w keeps keys in (pos - w, pos]; the libraries keep [pos - left, pos]: the same keys."""
    for w in (1, 3, 8):
        pos, left = 20, fc.window_left(w)
        assert [k for k in range(pos + 1) if k > pos - w] == [k for k in range(pos + 1) if k >= pos - left]


def test_as_int32_returns_contiguous_int32_and_copies_only_when_needed():
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    assert fc.as_int32(t) is t
    converted = fc.as_int32(t.long())
    assert converted.dtype == torch.int32 and torch.equal(converted, t)
    transposed = fc.as_int32(t.t())
    assert transposed.is_contiguous() and transposed.dtype == torch.int32 and torch.equal(transposed, t.t())
