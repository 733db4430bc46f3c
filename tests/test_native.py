"""hf_paged/native.py: C sources built once per source, compiler, flags and CPU; `CC` may carry arguments."""
import ctypes
import shutil

import pytest

from hf_paged import native


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "twice.c"
    path.write_text("long twice(long x) { return 2 * x; }\n")
    return path


def test_cc_may_carry_arguments(source, monkeypatch):
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "this machine builds the CPU kernels: it has a C compiler"
    monkeypatch.setenv("CC", f"env {compiler}")  # like CC="ccache gcc"
    lib = ctypes.CDLL(str(native.build(source)))
    lib.twice.restype, lib.twice.argtypes = ctypes.c_long, [ctypes.c_long]
    assert lib.twice(21) == 42


def test_a_cache_shared_by_machines_keeps_one_build_per_cpu(source, monkeypatch):
    """-march=native builds for the CPU it runs on: another CPU gets its own build, never this one's."""
    here = native.build(source)
    assert native.build(source) == here and native.is_complete(here)
    monkeypatch.setattr(native, "cpu_identity", lambda: "another CPU with other instructions")
    there = native.build(source)
    assert there != here and native.is_complete(there)


def test_no_compiler_is_a_runtime_error(source, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build(source)


def test_native_entry_points_are_never_traced_by_dynamo():
    """Every call into hf_paged's native code (raw pointers through ctypes) is `torch.compiler.disable`d: dynamo
    tracing a compiled model into the CPU decode kernel's call corrupted the heap ("malloc(): unaligned tcache chunk
    detected": `model.compile(backend="eager")`, then `LLM(model).generate(...)` on a 1-layer bf16 tiny llama; with
    the decorator the tokens equal the uncompiled model's)."""
    from hf_paged.attention.cpu_kernel import CpuDecodeKernel
    from hf_paged.model import gated_delta
    from hf_paged.model.small_linear import SmallGemm

    def original(*args, **kwargs):
        return None

    entry_points = [CpuDecodeKernel.__call__, SmallGemm.__call__, gated_delta.recurrent_step(original),
                    gated_delta.conv_step(original)]
    assert all(getattr(f, "_torchdynamo_disable", False) for f in entry_points)
