"""attention/cuda_backend.py: building the extension ahead (HF_PAGED_BUILD_CUDA=1) works or says why not, and an
installed package reads the CUDA sources it carries. (Compiling the kernels is test_cuda_build.py's.)"""
import os
import subprocess
import sys
from pathlib import Path

import torch

from hf_paged.attention import cuda_backend

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def test_build_ahead_flag():
    """HF_PAGED_BUILD_CUDA=1 builds at import where it can (on a GPU machine: the build, cached afterwards);
    elsewhere importing still works and the module says why there is no extension."""
    proc = subprocess.run([sys.executable, "-m", "hf_paged.attention.cuda_backend"], capture_output=True, text=True,
                          env={**os.environ, "HF_PAGED_BUILD_CUDA": "1"}, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "hf_paged CUDA extension:" in proc.stdout
    if not torch.cuda.is_available():
        assert "loaded" not in proc.stdout


def test_installed_package_carries_the_cuda_sources(tmp_path):
    """setup.py's build_py copies csrc/ into the package (hf_paged/_csrc), and the backend of a package
    installed that way reads its sources from there, not from a repository that is no longer around."""
    root = Path(__file__).resolve().parents[1]
    build = tmp_path / "build"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)], cwd=root,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in cuda_backend.SOURCES + cuda_backend.HEADERS:
        assert (build / "hf_paged" / "_csrc" / name).read_bytes() == (CSRC / name).read_bytes()
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_CSRC"}
    env["PYTHONPATH"] = str(build)
    code = "from hf_paged.attention import cuda_backend as c; print(c.CSRC)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert Path(out) == build / "hf_paged" / "_csrc"
