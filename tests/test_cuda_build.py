"""The CUDA sources in csrc/ compile, without a GPU: every kernel of paged_attention.cu through nvcc + ptxas
(Hopper sm_90a and Ampere sm_80, register / spill report printed, no spills allowed in the decode kernels), and
bindings.cpp against torch's headers with the host compiler. (The backend's CPU-side rules are
test_attention_backends_cuda.py's, its build and installed sources test_cuda_backend.py's.)

Run with -s to see the ptxas table. Skips (with the reason) where nvcc or a host compiler is missing.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

CSRC = Path(__file__).resolve().parents[1] / "csrc"
NVCC = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                if os.environ.get("CUDA_HOME") else None)
ARCHES = ("sm_90a", "sm_80")
# what torch.utils.cpp_extension passes to nvcc (half / bf16 operators off: the kernels use explicit intrinsics)
TORCH_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True,
                         check=False).stdout.splitlines()
    return out if len(out) == len(names) else names


def parse_ptxas(text: str) -> list[dict]:
    """One entry per kernel: name, registers, spill store / load bytes, stack frame bytes."""
    kernels, current = [], None
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = {"mangled": m.group(1), "registers": None, "spill_stores": 0, "spill_loads": 0, "stack": 0}
            kernels.append(current)
        elif current is not None and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                                      r"(\d+) bytes spill loads", line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
    for kernel, name in zip(kernels, _demangle([k["mangled"] for k in kernels])):
        kernel["name"] = re.sub(r"hf_paged::\(anonymous namespace\)::", "", name)
    return kernels


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    out = tmp_path_factory.mktemp("nvcc")
    procs = {arch: subprocess.Popen([NVCC, "-std=c++17", "-O3", f"-arch={arch}", *TORCH_NVCC_FLAGS, "-Xptxas", "-v",
                                     "-c", str(CSRC / "paged_attention.cu"), "-o", str(out / f"{arch}.o")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for arch in ARCHES}  # both at once: ~15 s each on 2 cores
    reports = {}
    for arch, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"nvcc -arch={arch} failed:\n{text[-4000:]}"
        reports[arch] = parse_ptxas(text)
    return reports


@pytest.mark.parametrize("arch", ARCHES)
def test_kernels_compile_without_spills(ptxas_reports, arch):
    kernels = ptxas_reports[arch]
    print(f"\nptxas {arch}: registers / spill stores / spill loads (bytes) / stack")
    for k in sorted(kernels, key=lambda k: k["name"]):
        print(f"  {k['registers']:>4} {k['spill_stores']:>4} {k['spill_loads']:>4} {k['stack']:>4}  {k['name']}")
    decode = [k for k in kernels if "paged_decode_kernel<" in k["name"]]
    assert len(decode) == 3 * 3 * 4, "decode kernels for 3 dtypes x head dims 64/128/256 x GQA groups 1/2/4/8"
    assert any("paged_decode_reduce_kernel<" in k["name"] for k in kernels)
    assert any("store_kv_kernel<" in k["name"] for k in kernels)
    assert any("copy_blocks_kernel<" in k["name"] for k in kernels)
    spilling = [k["name"] for k in kernels if k["spill_stores"] or k["spill_loads"]]
    assert not spilling, f"kernels spill registers: {spilling}"
    assert all(k["registers"] is not None and k["registers"] <= 255 for k in kernels)


def _torch_include_dirs() -> list[str]:
    root = Path(torch.__file__).parent / "include"
    return [str(root), str(root / "torch" / "csrc" / "api" / "include")]


def test_bindings_compile_against_torch_headers(tmp_path):
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None or NVCC is None:
        pytest.skip("needs a C++ compiler and the CUDA toolkit headers")
    from torch.utils.cpp_extension import CUDA_HOME

    homes = [os.environ.get("CUDA_HOME"), CUDA_HOME, Path(NVCC).resolve().parents[1], "/usr/local/cuda"]
    cuda_include = next((Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()),
                        None)
    if cuda_include is None:
        pytest.skip(f"no include/cuda_runtime_api.h under any of {homes}")
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not (Path(_torch_include_dirs()[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        stub.parent.mkdir(parents=True)  # CPU-only torch wheels ship c10/cuda headers without this generated one
        stub.write_text("#pragma once\n")
    includes = [f"-I{d}" for d in (*_torch_include_dirs(), str(cuda_include), str(tmp_path), str(CSRC))]
    proc = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", "-Wall", *includes, str(CSRC / "bindings.cpp")],
                          capture_output=True, text=True, timeout=300, check=False)
    errors = [line for line in proc.stderr.splitlines() if "bindings.cpp" in line and "error" in line]
    assert proc.returncode == 0 and not errors, proc.stderr[-4000:]
